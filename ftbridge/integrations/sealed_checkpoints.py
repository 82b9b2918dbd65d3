"""Hugging Face checkpoints, sealed: a resume takes the newest one that was written whole.

:func:`seal` fsyncs a written checkpoint and writes its ``manifest.json`` (:mod:`ftbridge.checkpoint.manifest`)
before any older one is rotated away; :func:`latest_sealed` and :func:`resume_path` take the newest folder
that matches its manifest. Why: docs/huggingface.md (checkpoints under Accelerate and the Trainer).
"""

from __future__ import annotations

import logging
import os
import re
from typing import List, Optional, Pattern, Tuple

from ftbridge.checkpoint import manifest

TRAINER = re.compile(r"^checkpoint-(\d{1,18})$")
"""The Trainer's checkpoint folder names (``PREFIX_CHECKPOINT_DIR``-``global_step``)."""
ACCELERATE = re.compile(r"^checkpoint_(\d{1,18})$")
"""Accelerate's automatically named ``save_state`` folders (``checkpoint_<iteration>``)."""

log = logging.getLogger(__name__)


def seal(checkpoint_dir: str) -> None:
    """fsync every file under ``checkpoint_dir``, then write its manifest (atomically, fsynced).

    Raises:
        OSError: a file cannot be synced or the manifest written; the folder stays unsealed (a resume skips it).
    """
    for dirpath, _, names in os.walk(checkpoint_dir):
        for name in names:
            manifest.fsync_path(os.path.join(dirpath, name))
        manifest.fsync_path(dirpath)
    manifest.write_manifest(checkpoint_dir, extra={"written_by": "ftbridge (Hugging Face integration)"})


def problems(checkpoint_dir: str) -> List[str]:
    """Why ``checkpoint_dir`` is not whole: no manifest, a file missing, added, truncated or altered; empty if whole."""
    return manifest.verify(checkpoint_dir)


def checkpoints(output_dir: str, names: Pattern[str] = TRAINER) -> List[Tuple[int, str]]:
    """``(number, path)`` of every folder in ``output_dir`` whose name ``names`` matches, newest first."""
    found = []
    for entry in os.scandir(output_dir):
        match = names.match(entry.name)
        if match and entry.is_dir(follow_symlinks=False):
            found.append((int(match.group(1)), entry.path))
    return sorted(found, reverse=True)


def latest_sealed(output_dir: str, names: Pattern[str] = TRAINER) -> Optional[str]:
    """The newest whole checkpoint in ``output_dir`` named as ``names`` matches, or ``None``; logs (WARNING)
    each newer folder passed over."""
    if not os.path.isdir(output_dir):
        return None
    for _, path in checkpoints(output_dir, names):
        found = problems(path)
        if not found:
            return path
        log.warning("skipping %s: not a whole sealed checkpoint (%s%s)", path, found[0],
                    f", and {len(found) - 1} more" if len(found) > 1 else "")
    return None


def check_named(folder: str) -> None:
    """Refuse a named checkpoint whose files do not match its manifest (one without a manifest passes).

    Raises:
        ValueError: naming the folder and its first problems, and the fix.
    """
    if os.path.exists(os.path.join(folder, manifest.MANIFEST)):
        found = problems(folder)
        if found:
            raise ValueError(f"checkpoint {folder!r} does not match its manifest: " + "; ".join(found[:5])
                             + ": load an older checkpoint, or the newest whole one")


def resume_path(resume_from_checkpoint: object, output_dir: str) -> object:
    """What the Trainer's ``train(resume_from_checkpoint=...)`` should get, sealed checkpoints only.

    Args:
        resume_from_checkpoint: the caller's value: ``True`` (the newest), a folder, or ``None``/``False``.
        output_dir: ``TrainingArguments.output_dir``.

    Returns:
        ``True`` becomes :func:`latest_sealed`'s folder; any other value is returned as given.

    Raises:
        ValueError: ``True`` and no whole sealed checkpoint in ``output_dir``; or a folder that has a
            manifest but does not match it (each problem named).
    """
    if resume_from_checkpoint is True:
        path = latest_sealed(output_dir)
        if path is None:
            raise ValueError(f"resume_from_checkpoint=True: no whole checkpoint in {output_dir} (a "
                             "checkpoint-<step> folder sealed with a manifest.json that its files match); resume "
                             "from a folder by name, or start without resume_from_checkpoint")
        return path
    if isinstance(resume_from_checkpoint, str):
        check_named(resume_from_checkpoint)
    return resume_from_checkpoint
