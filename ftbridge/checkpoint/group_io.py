"""Save and load one replica group's checkpoint with DeepSpeed's own layout.

:func:`save_group_checkpoint`: every rank of the writing group saves through DeepSpeed's
``save_checkpoint`` into the staging folder (the training stall), then, inline or in the background,
writes and fsyncs its files and leaves a ``.done_rank_<k>`` marker; group rank 0 writes the manifest,
publishes, moves ``latest`` and prunes. No collective runs in the background.
:func:`load_group_checkpoint`: every file checked by some rank, then DeepSpeed's ``load_checkpoint``.
Sequence and reasoning: ``docs/checkpoints.md``, "How it works".
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

import torch.distributed as dist

from ftbridge import faults
from ftbridge.checkpoint import manifest as mf
from ftbridge.checkpoint.async_save import BackgroundWriter, SnapshotCheckpointEngine
from ftbridge.checkpoint.safe_load import (
    UnsafeCheckpointError,
    checkpoint_files,
    files_of_rank,
    load_deepspeed_checkpoint,
)
from ftbridge.checkpoint.store import METADATA, CheckpointInfo, CheckpointStore, tag_for
from ftbridge.checkpoint.verified_read import CorruptFileError, load_checked
from ftbridge.device import exchange_in_group
from ftbridge.zero.checkpoint_engines import (
    DelegatingCheckpointEngine,
    swapped_checkpoint_engine,
    zipfile_serialization,
)

logger = logging.getLogger(__name__)


@dataclass
class SaveResult:
    """What one rank saw of one save."""

    tag: str
    stall_s: float
    """Training-thread seconds of the save (state assembly, sync writes or snapshot copies, waits)."""
    published: Dict[str, Any] = field(default_factory=dict)
    """Filled by group rank 0 once published: ``path``, ``total_bytes``, ``write_s``; ``skipped`` if not."""


def _rank_file(rank: int) -> str:
    return f"ftbridge_rank_{rank}.pt"


def save_group_checkpoint(ds_engine: Any, store: CheckpointStore, step: int, *, quorum_id: int,
                          metadata: Dict[str, Any], rank_state: Dict[str, Any], keep: int = 0,
                          writer: Optional[BackgroundWriter] = None,
                          on_published: Optional[Callable[[Dict[str, Any]], None]] = None,
                          publish_timeout_s: float = 300.0, log: Any = logger) -> SaveResult:
    """Write this group's checkpoint of ``step``; all ranks of the group call it together.

    Args:
        ds_engine: the DeepSpeed engine (its world is the replica group).
        store: checkpoint folder.
        step: committed steps (tag ``global_step<step>``).
        quorum_id: quorum of the step (names the staging folder).
        metadata: ``ftbridge.json`` content, also stored as DeepSpeed ``client_state["ftbridge"]``.
        rank_state: this rank's extra state (tensors and scalars), saved as ``ftbridge_rank_<k>.pt``.
        keep: keep the newest K checkpoints (0: all).
        writer: background writer for an async save; ``None`` writes now.
        on_published: called on group rank 0 with ``SaveResult.published``.
        publish_timeout_s: how long group rank 0 waits for the other ranks' files.

    Returns:
        This rank's :class:`SaveResult` (``published`` fills in later when async).

    Raises:
        Whatever DeepSpeed's ``save_checkpoint`` raises; errors of the finishing phase are logged and
        nothing is published.
    """
    t0 = time.perf_counter()
    rank, size = dist.get_rank(), dist.get_world_size()
    tag = tag_for(step)
    staging_root = store.staging_dir(tag, quorum_id)
    if rank == 0:
        os.makedirs(store.root, exist_ok=True)
        shutil.rmtree(staging_root, ignore_errors=True)  # an earlier attempt under the same name
    waited = writer.wait() if writer is not None else 0.0  # the next save waits for the previous
    ce = SnapshotCheckpointEngine(asynchronous=writer is not None,
                                  zipfile_serialization=zipfile_serialization(ds_engine))
    plugged = DelegatingCheckpointEngine("FTBridgeSnapshotCheckpointEngine", save=ce.save,
                                         zipfile_serialization=ce.zipfile_serialization)
    with swapped_checkpoint_engine(ds_engine, plugged):
        ds_engine.save_checkpoint(staging_root, tag=tag, client_state={"ftbridge": metadata}, save_latest=False)
    staged = os.path.join(staging_root, tag)
    ce.save(rank_state, os.path.join(staged, _rank_file(rank)))
    if rank == 0:
        mf.write_json_atomic(os.path.join(staged, METADATA), metadata)
    pending = ce.take()
    result = SaveResult(tag=tag, stall_s=0.0)

    def finish() -> None:
        tw = time.perf_counter()
        ce.write_pending(pending)
        hashed = {os.path.relpath(p, staged): e for p, e in ce.written.items() if p.startswith(staged + os.sep)}
        # The marker only coordinates the ranks (never part of the checkpoint): no fsync.
        mf.write_json_atomic(os.path.join(staged, f".done_rank_{rank}"), hashed, durable=False)
        if rank != 0:
            return
        known = _wait_for_markers(staged, size, publish_timeout_s)
        manifest = mf.write_manifest(staged, {"tag": tag, "step": step}, known, key=store.key)
        faults.point("checkpoint_publish", f"before publishing {staged}")
        _quarantine_if_bad(store, tag, log)
        if not mf.publish(staged, store.root, tag):
            log.warning("checkpoint %s is already published; this copy is dropped", tag)
            result.published = {"skipped": True, "path": os.path.join(store.root, tag)}
        else:
            # The newest publish is the job's current state, even at a lower step (after a resume fell
            # back past a damaged checkpoint): one writer at a time, so "latest" follows publish order.
            mf.update_latest(store.root, tag)
            result.published = {"path": os.path.join(store.root, tag), "total_bytes": manifest["total_bytes"],
                                "write_s": time.perf_counter() - tw}
        # Deleting old checkpoints needs no wait (unlinking 10s of MB took 30 ms per save here).
        threading.Thread(target=_cleanup, args=(store, staging_root, keep, log, tag), daemon=True,
                         name="ftbridge-ckpt-prune").start()
        if on_published is not None:
            on_published(result.published)

    if writer is not None:
        waited += writer.submit(finish)
        result.stall_s = time.perf_counter() - t0
    else:
        try:
            finish()
        except Exception as e:
            log.error("checkpoint %s not published: %r", tag, e, exc_info=True)
        result.stall_s = time.perf_counter() - t0
    return result


def _quarantine_if_bad(store: CheckpointStore, tag: str, log: Any) -> None:
    """Move a published but damaged ``tag`` aside (``.bad-<tag>-<pid>``) so this save can replace it."""
    final = os.path.join(store.root, tag)
    if not os.path.isdir(final):
        return
    step = int(tag[len("global_step"):])
    problems = CheckpointInfo(tag, step, final, store.key).problems()
    if problems:
        aside = os.path.join(store.root, f".bad-{tag}-{os.getpid()}")
        os.rename(final, aside)
        log.warning("moved the damaged checkpoint %s to %s (%s) to publish it again", final, aside, problems[0])


def _cleanup(store: CheckpointStore, staging_root: str, keep: int, log: Any, published: str) -> None:
    shutil.rmtree(staging_root, ignore_errors=True)
    try:
        store.prune(keep, log, verified=published)
    except OSError as e:  # a concurrent prune removed it first
        log.warning("pruning old checkpoints: %r", e)


def _wait_for_markers(staged: str, size: int, timeout_s: float) -> Dict[str, Any]:
    """Wait for every rank's ``.done_rank_<k>`` marker; remove them; return their merged file hashes."""
    deadline = time.monotonic() + timeout_s
    while True:
        missing = [k for k in range(size) if not os.path.exists(os.path.join(staged, f".done_rank_{k}"))]
        if not missing:
            known: Dict[str, Any] = {}
            for k in range(size):
                marker = os.path.join(staged, f".done_rank_{k}")
                with open(marker, encoding="utf-8") as f:
                    known.update(json.load(f))
                os.remove(marker)
            return known
        if time.monotonic() > deadline:
            raise TimeoutError(f"group ranks {missing} did not finish writing {staged} within {timeout_s} s; "
                               "the checkpoint is not published")
        time.sleep(0.005)


def load_group_checkpoint(ds_engine: Any, ckpt: CheckpointInfo) -> Dict[str, Any]:
    """Load ``ckpt`` into ``ds_engine`` safely; all ranks of the group call it together.

    Each rank reads, hashes and parses the files it loads
    (:func:`~ftbridge.checkpoint.safe_load.files_of_rank`, :func:`~ftbridge.checkpoint.verified_read.load_checked`);
    one all-reduce then stops the whole group on any failure before state changes; then DeepSpeed's
    ``load_checkpoint`` (module, ZeRO partition, lr scheduler, counters) with no pickle code run.

    Returns:
        This rank's ``ftbridge_rank_<k>.pt`` content.

    Raises:
        CorruptFileError: a file or the manifest does not match (the rank that found it names the file,
            the others that rank); on every rank before any state changes.
        UnsafeCheckpointError: a file needs a type outside the allowlist; likewise, and takes precedence.
        RuntimeError: DeepSpeed found nothing to load.
    """
    rank, size = dist.get_rank(), dist.get_world_size()
    rank_file = os.path.abspath(os.path.join(ckpt.path, _rank_file(rank)))
    error: Optional[BaseException] = None
    try:
        files = mf.read_manifest(ckpt.path, ckpt.key)["files"]
        paths = files_of_rank(checkpoint_files(ckpt.path), rank, size)
        preloaded = load_checked(paths if rank_file in paths else [*paths, rank_file], files)
    except UnsafeCheckpointError as e:  # agreed on first: a rank raising alone would leave the others waiting
        error = e
    except (OSError, ValueError) as e:  # CorruptFileError, or the manifest itself unreadable
        error = e if isinstance(e, CorruptFileError) else CorruptFileError(f"{ckpt.path}: {e}")
    corrupt, unsafe = _first_failed_ranks(error, size)
    if error is not None:
        raise error
    if unsafe is not None:
        raise UnsafeCheckpointError(f"group rank {unsafe} refused a file of {ckpt.path} (its log names the file "
                                    "and the type); nothing was loaded")
    if corrupt is not None:
        raise CorruptFileError(f"group rank {corrupt} found a file of {ckpt.path} that does not match the "
                               "manifest (its log names the file); nothing was loaded")
    path, _ = load_deepspeed_checkpoint(ds_engine, os.path.dirname(ckpt.path), ckpt.tag, preloaded=preloaded,
                                        load_optimizer_states=True, load_lr_scheduler_states=True)
    if path is None:
        raise RuntimeError(f"DeepSpeed loaded nothing from {ckpt.path}")
    return preloaded[rank_file]  # parsed from memory of its own: nothing depends on the file


def _first_failed_ranks(error: Optional[BaseException], size: int) -> Tuple[Optional[int], Optional[int]]:
    """The lowest group ranks that found a damaged and a refused file (``None``: none), by one in-group exchange."""
    unsafe = isinstance(error, UnsafeCheckpointError)
    rows = exchange_in_group([float(error is not None and not unsafe), float(unsafe)], size)
    corrupt = [r for r, row in enumerate(rows) if row[0]]
    refused = [r for r, row in enumerate(rows) if row[1]]
    return (corrupt[0] if corrupt else None), (refused[0] if refused else None)
