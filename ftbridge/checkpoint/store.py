"""A folder of replica-group checkpoints (:class:`CheckpointStore`): list, pick the newest valid, keep the last K.

A checkpoint is trusted only when every file matches its manifest. Layout: docs/checkpoints.md.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Collection, Dict, List, Optional, Tuple

from ftbridge.checkpoint import manifest as mf

METADATA = "ftbridge.json"
TAG_RE = re.compile(r"^global_step(\d+)$")
TMP_PREFIX = ".tmp-"
LEFTOVER_RE = re.compile(r"^(?:\.tmp-global_step(?P<step>\d+)-q\d+|\.bad-global_step(?P<bad>\d+)-\d+|latest\.tmp\d+)$")
"""Names :meth:`CheckpointStore.prune` may remove: staging folders, quarantined copies, ``latest`` temporaries."""
STALE_TMP_S = 60.0
"""Age (s) after which a ``latest.tmp<pid>`` file is a leftover (writing ``latest`` takes milliseconds)."""
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


class SlotsMismatchError(ValueError):
    """The checkpoint was saved with another number of slots (:attr:`ftbridge.config.FTBridgeConfig.slots`)."""


class GroupSizeMismatchError(ValueError):
    """The checkpoint was saved by replica groups of another size (or another ZeRO stage family)."""


def tag_for(step: int) -> str:
    """Checkpoint tag of ``step`` (DeepSpeed's default tag, ``global_step<N>``)."""
    return f"global_step{step}"


def required_files(group_size: int, zero_stage: int = 2) -> List[str]:
    """Files a checkpoint of ``group_size`` ranks must list besides :func:`optimizer_shards`, per ZeRO stage."""
    model = (["mp_rank_00_model_states.pt"] if zero_stage != 3 else
             [f"zero_pp_rank_{k}_mp_rank_00_model_states.pt" for k in range(group_size)])
    return [METADATA, *(f"ftbridge_rank_{k}.pt" for k in range(group_size)), *model]


def optimizer_shards(rank: int) -> Tuple[str, str]:
    """The two names DeepSpeed 0.19 gives group rank ``rank``'s ZeRO optimizer shard (with bf16: ``bf16_`` prefix)."""
    name = f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
    return name, f"bf16_{name}"


def check_metadata(meta: Any, path: str, max_group_size: int) -> Dict[str, Any]:
    """``meta`` if it is a usable ``ftbridge.json``, else ValueError naming ``path``, the field and the bound.

    ``max_group_size``: the largest group size the manifest can hold (two files per rank at least).
    """
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: metadata is a {type(meta).__name__}, not a JSON object")
    if not mf.is_int(meta.get("group_size"), 1, max_group_size):
        raise ValueError(f"{path}: group_size {meta.get('group_size')!r} is not an integer between 1 and "
                         f"{max_group_size} (the files listed in the manifest hold at most that many ranks)")
    if not mf.is_int(meta.get("zero_stage"), 1, 3):
        raise ValueError(f"{path}: zero_stage {meta.get('zero_stage')!r} is not 1, 2 or 3")
    if not mf.is_int(meta.get("step"), 0, 2**62):
        raise ValueError(f"{path}: step {meta.get('step')!r} is not a non-negative integer")
    if "slots" in meta and not mf.is_int(meta["slots"], 0, 2**20):
        raise ValueError(f"{path}: slots {meta['slots']!r} is not an integer between 0 and {2**20}")
    for key in ("quorum", "manager", "engine_counters", "data_position", "dtypes", "versions"):
        if key in meta and not isinstance(meta[key], dict):
            raise ValueError(f"{path}: {key} is a {type(meta[key]).__name__}, not a JSON object")
    return meta


@dataclass
class CheckpointInfo:
    """One published checkpoint folder."""

    tag: str
    step: int
    path: str
    key: Optional[bytes] = field(default=None, repr=False)
    """Checkpoint key (``manifest.hmac`` is then required and checked); ``None``: no HMAC check."""

    def metadata(self) -> Dict[str, Any]:
        """Its ``ftbridge.json``: hashed against the manifest first, then parsed (bounded) and shape-checked.

        Raises:
            OSError: the manifest or the metadata is missing or unreadable.
            ValueError: not listed, SHA-256 differs, not JSON, or a field out of bounds (:func:`check_metadata`).
        """
        path = os.path.join(self.path, METADATA)
        files = mf.read_manifest(self.path, self.key)["files"]
        want = files.get(METADATA)
        if want is None:
            raise ValueError(f"{path}: not in the manifest")
        data = mf.read_bounded(path, min(want["bytes"], mf.MAX_JSON_BYTES))
        if hashlib.sha256(data).hexdigest() != want["sha256"]:
            raise ValueError(f"{path}: SHA-256 differs from the manifest (altered)")
        return check_metadata(mf.parse_json(data, path), path, max(1, len(files) // 2))

    def problems(self, hash_torch_files: bool = True) -> List[str]:
        """What is wrong with it (empty: trusted): files against the manifest, metadata, tag, step, file set.

        ``hash_torch_files=False`` (a resume: its ranks hash what they parse) checks the ``.pt`` files' listing,
        type and size but does not hash them.
        """
        later = [] if hash_torch_files else [os.path.basename(p) for p in mf.checkpoint_files(self.path)]
        problems = mf.verify(self.path, key=self.key, hashed_later=later)
        if problems:
            return problems
        try:
            manifest = mf.read_manifest(self.path, self.key)
            meta = self.metadata()
        except (OSError, ValueError) as e:
            return [f"{os.path.join(self.path, METADATA)}: unusable metadata ({e})"]
        if manifest.get("tag", self.tag) != self.tag or manifest.get("step", self.step) != self.step \
                or meta["step"] != self.step:
            return [f"{self.path}: folder is step {self.step}, but the manifest says tag {manifest.get('tag')!r} "
                    f"step {manifest.get('step')!r} and the metadata step {meta['step']} (renamed?)"]
        listed = manifest["files"]
        size = meta["group_size"]
        for rel in required_files(size, meta["zero_stage"]):
            if rel not in listed:
                problems.append(f"{os.path.join(self.path, rel)}: required file not in the manifest")
        for k in range(size):
            if not any(name in listed for name in optimizer_shards(k)):
                problems.append(f"{self.path}: no ZeRO optimizer shard of group rank {k} in the manifest")
        return problems


class CheckpointStore:
    """The checkpoints under ``root`` (created on the first save).

    With ``key`` (:func:`load_key`) every checkpoint must carry a matching ``manifest.hmac``.
    """

    def __init__(self, root: str, key: Optional[bytes] = None) -> None:
        self.root = os.path.abspath(root)
        self.key = key

    def list(self) -> List[CheckpointInfo]:
        """Published checkpoints, oldest step first (unverified)."""
        try:
            names = os.listdir(self.root)
        except (FileNotFoundError, NotADirectoryError):
            return []
        found = []
        for name in names:
            m = TAG_RE.match(name)
            path = os.path.join(self.root, name)
            if m and os.path.isdir(path):
                found.append(CheckpointInfo(name, int(m.group(1)), path, self.key))
        return sorted(found, key=lambda c: c.step)

    def find_valid(self, log: Any = logger, *, hash_torch_files: bool = True,
                   skip: Collection[int] = ()) -> Optional[CheckpointInfo]:
        """The newest checkpoint whose files all match its manifest, logging each one skipped with its problems.

        Args:
            hash_torch_files: see :meth:`CheckpointInfo.problems`.
            skip: steps the caller already found damaged.

        Returns:
            The checkpoint, or ``None`` when the folder holds none at all.

        Raises:
            NoValidCheckpointError: checkpoints exist but none verifies (all problems listed).
        """
        found = self.list()
        bad: List[str] = [f"{c.path}: a file did not match the manifest when loaded" for c in found if c.step in skip]
        for ckpt in reversed([c for c in found if c.step not in skip]):
            problems = ckpt.problems(hash_torch_files)
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

    def prune(self, keep: int, log: Any = logger, verified: Optional[str] = None) -> List[str]:
        """Delete old checkpoints and leftovers, never the newest verified one or the one ``latest`` names.

        Keeps the newest ``keep`` (0: all) besides those two; ``verified``: a tag known good without re-hashing.
        Leftovers (:data:`LEFTOVER_RE`) go only up to the newest checkpoint's step, and never through a link.
        Returns the paths removed.
        """
        found = self.list()
        removed = []
        if keep > 0 and len(found) > keep:
            protect = {mf.read_latest(self.root)}
            for ckpt in reversed(found):  # the newest checkpoint that verifies
                if ckpt.tag == verified or not ckpt.problems():
                    protect.add(ckpt.tag)
                    break
            for ckpt in found[:-keep]:
                if ckpt.tag not in protect and not os.path.islink(ckpt.path):
                    shutil.rmtree(ckpt.path, ignore_errors=True)
                    removed.append(ckpt.path)
        removed += self._remove_leftovers(found[-1].step if found else -1)
        if removed:
            log.info("removed old checkpoints and leftovers %s", [os.path.basename(p) for p in removed])
        return removed

    def _remove_leftovers(self, newest: int) -> List[str]:
        removed: List[str] = []
        try:
            entries = list(os.scandir(self.root))
        except OSError:
            return removed
        now = time.time()
        for entry in entries:
            m = LEFTOVER_RE.match(entry.name)
            if m is None or entry.is_symlink():
                continue
            step = m.group("step") or m.group("bad")
            if step is not None and entry.is_dir(follow_symlinks=False) and int(step) <= newest:
                shutil.rmtree(entry.path, ignore_errors=True)
            elif (step is None and entry.is_file(follow_symlinks=False)
                  and now - entry.stat(follow_symlinks=False).st_mtime > STALE_TMP_S):
                os.remove(entry.path)
            else:
                continue
            removed.append(entry.path)
        return removed


def load_key(path: Optional[str], root: str) -> Optional[bytes]:
    """The checkpoint key in file ``path`` (``None`` for ``None``), read bounded to 4096 bytes.

    Raises:
        ValueError: the file lies inside the checkpoint folder ``root``, is missing, a folder or not a
            regular file, or holds fewer than 16 bytes.
        OSError: the file cannot be read.
    """
    if path is None:
        return None
    real, real_root = os.path.realpath(path), os.path.realpath(root)
    if os.path.commonpath([real, real_root]) == real_root:
        raise ValueError(f"checkpoint key file {path} lies inside the checkpoint folder {root}; keep it outside "
                         "(whoever can rewrite the checkpoint could then rewrite its HMAC too)")
    if not os.path.isfile(real):
        what = "a folder" if os.path.isdir(real) else "missing" if not os.path.lexists(path) else "not a regular file"
        raise ValueError(f"checkpoint key file {path} is {what}; give the path of the file that holds the key "
                         "(--key-file / --checkpoint-key-file or $FTBRIDGE_CKPT_KEY_FILE)")
    key = mf.read_bounded(real, 4096).strip()
    if len(key) < 16:
        raise ValueError(f"checkpoint key file {path} holds {len(key)} bytes; use at least 16 random bytes, e.g. "
                         "head -c 32 /dev/urandom | base64 > KEYFILE")
    return key


def check_compatible(meta: Dict[str, Any], path: str, *, group_size: int, zero_stage: int,
                     slots: Optional[int] = None) -> None:
    """Refuse a checkpoint this replica group cannot load, before any state is touched.

    Args:
        meta: the checkpoint's ``ftbridge.json``; ``path``: its folder, for messages.
        slots: this job's slots (0: off); ``None`` accepts any. A ``meta`` without the field means 0.

    Raises:
        GroupSizeMismatchError: another ``group_size`` (the message gives the conversion), or ZeRO-3
            against ZeRO-1/2.
        SlotsMismatchError: saved with other slots.
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
    saved_slots = meta.get("slots", 0)
    if slots is not None and saved_slots != slots:
        raise SlotsMismatchError(
            f"checkpoint {path} was saved with slots={saved_slots}, this job has slots={slots} (FTBRIDGE_SLOTS): "
            "the global batch and the rows of each step would differ from the saved run's; nothing was loaded. "
            f"Resume with FTBRIDGE_SLOTS={saved_slots}, or accept the change with --resume-other-slots "
            "(CheckpointConfig.allow_other_slots).")
