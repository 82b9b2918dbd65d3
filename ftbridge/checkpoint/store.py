"""A folder of replica-group checkpoints: list, pick the newest valid, keep the last K.

Layout (``ROOT`` is what ``--checkpoint-dir`` names; it is also a valid
DeepSpeed ``load_dir``: ``ROOT/latest`` holds the tag)::

    ROOT/latest                         tag of the newest published checkpoint
    ROOT/global_step<N>/                one checkpoint, DeepSpeed's files for a
        mp_rank_00_model_states.pt      data-parallel world of the group size
        zero_pp_rank_<k>_mp_rank_00_optim_states.pt   one per group rank k
        ftbridge.json                   ftbridge metadata (see :mod:`.state`)
        ftbridge_rank_<k>.pt            per-rank engine counters and user state
        manifest.json                   sizes and SHA-256 of all the above
    ROOT/.tmp-global_step<N>-q<Q>/      a write in progress (or abandoned)

A checkpoint is trusted only when every file matches its manifest;
:meth:`CheckpointStore.find_valid` walks from the newest step down, warns
naming each bad file, and raises :class:`NoValidCheckpointError` when
checkpoints exist but none can be trusted (never loads one silently).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from ftbridge.checkpoint import manifest as mf

METADATA = "ftbridge.json"
TAG_RE = re.compile(r"^global_step(\d+)$")
TMP_PREFIX = ".tmp-"
UNIVERSAL_HINT = (
    "DeepSpeed refuses to load a ZeRO checkpoint into another data-parallel size. Either restart with "
    "--nproc-per-node {saved} (any number of replica groups works), or convert it to a universal checkpoint "
    "and load that with DeepSpeed's \"checkpoint\": {{\"load_universal\": true}}:\n"
    "  python -m deepspeed.checkpoint.ds_to_universal --input_folder {path} --output_folder {path}_universal "
    "--inject_missing_state"
)

logger = logging.getLogger(__name__)


class NoValidCheckpointError(RuntimeError):
    """Checkpoints exist but none passes verification (each problem is in the message)."""


class GroupSizeMismatchError(ValueError):
    """The checkpoint was saved by replica groups of another size (or another ZeRO stage family)."""


def tag_for(step: int) -> str:
    """Checkpoint tag of ``step`` (DeepSpeed's default tag, ``global_step<N>``)."""
    return f"global_step{step}"


def required_files(group_size: int) -> List[str]:
    """Files every checkpoint of a group of ``group_size`` ranks must list in its manifest."""
    return [METADATA, *(f"ftbridge_rank_{k}.pt" for k in range(group_size))]


@dataclass
class CheckpointInfo:
    """One published checkpoint folder."""

    tag: str
    step: int
    path: str

    def metadata(self) -> Dict[str, Any]:
        """Its ``ftbridge.json`` (raises OSError/ValueError when unreadable)."""
        with open(os.path.join(self.path, METADATA), encoding="utf-8") as f:
            return json.load(f)

    def problems(self) -> List[str]:
        """What is wrong with it (empty: trusted). See :func:`ftbridge.checkpoint.manifest.verify`."""
        try:
            size = int(self.metadata()["group_size"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            return [f"{os.path.join(self.path, METADATA)}: unreadable metadata ({e})"]
        problems = mf.verify(self.path, required_files(size))
        if not problems:
            listed = mf.read_manifest(self.path)["files"]
            for k in range(size):
                if not any(name.startswith(f"zero_pp_rank_{k}_") for name in listed):
                    problems.append(f"{self.path}: no ZeRO shard of group rank {k} in the manifest")
        return problems


class CheckpointStore:
    """The checkpoints under ``root``.

    Args:
        root: checkpoint folder (created on the first save).
    """

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)

    def list(self) -> List[CheckpointInfo]:
        """Published checkpoints, oldest step first (unverified)."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        found = []
        for name in names:
            m = TAG_RE.match(name)
            path = os.path.join(self.root, name)
            if m and os.path.isdir(path):
                found.append(CheckpointInfo(name, int(m.group(1)), path))
        return sorted(found, key=lambda c: c.step)

    def find_valid(self, log: Any = logger) -> Optional[CheckpointInfo]:
        """The newest checkpoint whose files all match its manifest.

        Args:
            log: where warnings about skipped checkpoints go.

        Returns:
            The checkpoint, or ``None`` when the folder holds none at all.

        Raises:
            NoValidCheckpointError: checkpoints exist but every one has a
                missing, truncated or altered file (all problems listed).
        """
        found = self.list()
        bad = []
        for ckpt in reversed(found):
            problems = ckpt.problems()
            if not problems:
                if bad:
                    log.warning("loading the older checkpoint %s instead", ckpt.path)
                return ckpt
            bad.extend(problems)
            log.warning("checkpoint %s cannot be trusted, skipping it: %s", ckpt.path, "; ".join(problems))
        if found:
            raise NoValidCheckpointError(
                f"no valid checkpoint in {self.root}: every one of {[c.tag for c in found]} has a bad file:\n  "
                + "\n  ".join(bad) + "\nRemove the bad checkpoints or start without --resume.")
        return None

    def staging_dir(self, tag: str, quorum_id: int) -> str:
        """Folder a writer stages ``tag`` in (the same name on every rank of the group)."""
        return os.path.join(self.root, f"{TMP_PREFIX}{tag}-q{quorum_id}")

    def prune(self, keep: int, log: Any = logger) -> List[str]:
        """Delete all but the newest ``keep`` checkpoints, and abandoned staging folders of older steps.

        Args:
            keep: checkpoints to keep (0: keep all).

        Returns:
            The folders removed.
        """
        found = self.list()
        removed = []
        if keep > 0:
            for ckpt in found[:-keep]:
                shutil.rmtree(ckpt.path, ignore_errors=True)
                removed.append(ckpt.path)
        newest = found[-1].step if found else -1
        for name in os.listdir(self.root) if os.path.isdir(self.root) else []:
            m = re.match(rf"^{re.escape(TMP_PREFIX)}global_step(\d+)-q", name)
            if m and int(m.group(1)) <= newest:
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
                removed.append(os.path.join(self.root, name))
        if removed:
            log.info("removed old checkpoints %s", [os.path.basename(p) for p in removed])
        return removed


def check_compatible(meta: Dict[str, Any], path: str, *, group_size: int, zero_stage: int) -> None:
    """Refuse a checkpoint this replica group cannot load, before any state is touched.

    Args:
        meta: the checkpoint's ``ftbridge.json``.
        path: its folder (for the message).
        group_size: ranks in this replica group.
        zero_stage: this engine's ZeRO stage.

    Raises:
        GroupSizeMismatchError: another group size (names both sizes and the
            universal-checkpoint conversion), or ZeRO-3 against ZeRO-1/2.
    """
    saved = int(meta["group_size"])
    if saved != group_size:
        raise GroupSizeMismatchError(
            f"checkpoint {path} was saved by replica groups of {saved} ranks, but this replica group has "
            f"{group_size} ranks; nothing was loaded. " + UNIVERSAL_HINT.format(saved=saved, path=path))
    saved_stage = int(meta["zero_stage"])
    if (saved_stage == 3) != (zero_stage == 3):
        raise GroupSizeMismatchError(
            f"checkpoint {path} was saved with ZeRO stage {saved_stage}, this engine runs stage {zero_stage}; "
            "ZeRO-3 and ZeRO-1/2 partitions differ. Use the saved stage, or convert with "
            "python -m deepspeed.checkpoint.ds_to_universal --inject_missing_state; nothing was loaded.")
