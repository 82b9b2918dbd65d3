"""Checkpoints of a fault-tolerant job: when, who, and resume.

:class:`Checkpointer` hooks the engine's step: the group agrees whether a SIGTERM or a save request arrived, saves
where :func:`~ftbridge.checkpoint.writer.save_due` and :func:`~ftbridge.checkpoint.writer.is_writer` say so, and
after a SIGTERM sets :attr:`Checkpointer.stopping`. Why: docs/checkpoints.md, "How it works".

Example::

    ckpt = Checkpointer(engine, CheckpointConfig(dir="ckpt", every=50, keep=3, asynchronous=True))
    ckpt.resume()
    while engine.global_steps < steps and not ckpt.stopping:
        train_step(engine)
    ckpt.close()
"""

from __future__ import annotations

import logging
import os
import platform
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import deepspeed
import torch
import torch.distributed as dist

from ftbridge.checkpoint.async_save import BackgroundWriter
from ftbridge.checkpoint.group_io import load_group_checkpoint, save_group_checkpoint
from ftbridge.checkpoint.store import (
    CheckpointInfo,
    CheckpointStore,
    NoValidCheckpointError,
    check_compatible,
    load_key,
)
from ftbridge.checkpoint.verified_read import CorruptFileError
from ftbridge.checkpoint.writer import is_writer, save_due
from ftbridge.device import exchange_in_group
from ftbridge.events import tensor_checksum
from ftbridge.log import get_logger

FORMAT = "ftbridge-checkpoint/1"


@dataclass(kw_only=True)
class CheckpointConfig:
    """Checkpoint settings of one job (the same on every rank)."""

    dir: str
    """Checkpoint folder, shared by all replica groups (same file system)."""
    every: int = 0
    """Save every N committed steps (0: only on demand and on SIGTERM)."""
    keep: int = 3
    """Keep the newest K checkpoints (0: keep all)."""
    asynchronous: bool = False
    """Snapshot to CPU at the step boundary and write in the background."""
    trigger_file: Optional[str] = None
    """Save after the next step once this file exists (the writer deletes it). Default ``<dir>/SAVE_NOW``."""
    handle_sigterm: bool = True
    """SIGTERM: finish the step, save if writer, set :attr:`Checkpointer.stopping`."""
    sigterm_grace_s: Optional[float] = None
    """After a SIGTERM, longest wait (s) for the step in flight, then exit 143 (default
    ``FTBridgeConfig.sigterm_grace``)."""
    publish_timeout_s: float = 300.0
    """How long group rank 0 waits for the other ranks' files."""
    key_file: Optional[str] = None
    """Key file outside ``dir``: manifests are signed and only signed ones trusted. ``None``: no HMAC."""
    allow_other_slots: bool = False
    """Resume a checkpoint saved with other ``slots`` (refused by default: the global batch changes)."""

    def __post_init__(self) -> None:
        if self.every < 0 or self.keep < 0:
            raise ValueError(f"checkpoint every={self.every}, keep={self.keep}: both must be >= 0")
        if self.sigterm_grace_s is not None and self.sigterm_grace_s <= 0:
            raise ValueError(f"sigterm_grace_s={self.sigterm_grace_s} must be > 0 (or None for the default)")
        if self.trigger_file is None:
            self.trigger_file = os.path.join(self.dir, "SAVE_NOW")


class Checkpointer:
    """Saves and resumes replica-group checkpoints for the rank of ``engine`` (a
    :class:`~ftbridge.engine.FaultTolerantEngine`). Install it before the first step: it registers a step hook and,
    from the main thread, a SIGTERM handler.

    Raises:
        ValueError, OSError: a bad key file (:func:`~ftbridge.checkpoint.store.load_key`).
    """

    def __init__(self, engine: Any, cfg: CheckpointConfig) -> None:
        self.engine = engine
        self.cfg = cfg
        self.store = CheckpointStore(cfg.dir, load_key(cfg.key_file, cfg.dir))
        self.writer = BackgroundWriter() if cfg.asynchronous else None
        self.log = get_logger("ftbridge.checkpoint", engine.cfg, step_fn=lambda: engine.manager.current_step)
        self.stopping = False
        self.saves: list = []
        self._sigterm = False
        self._requested = False
        self._last_saved = -1
        self._grace: Optional[threading.Timer] = None
        grace = cfg.sigterm_grace_s
        self.sigterm_grace_s = grace if grace is not None else engine.cfg.sigterm_grace.total_seconds()
        engine.add_step_hook(self._after_step)
        if cfg.handle_sigterm and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)

    # -- requests ----------------------------------------------------------
    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self._sigterm = True
        if self._grace is None:  # the step in flight must finish within the grace, or this rank exits
            self._grace = threading.Timer(self.sigterm_grace_s, self._exit_stuck)
            self._grace.daemon = True
            self._grace.start()

    def _exit_stuck(self) -> None:
        self.log.error("SIGTERM %.0f s ago and the step in flight has not finished (a rank of this group is "
                       "gone?): exiting now so the other replica groups stop waiting for this one; committed "
                       "state lives on in them, published checkpoints are untouched", self.sigterm_grace_s)
        for handler in logging.getLogger().handlers + self.log.logger.handlers:
            handler.flush()
        os._exit(128 + signal.SIGTERM)

    def request_save(self) -> None:
        """Save after the next committed step (if this group is then the writer)."""
        self._requested = True

    def _agree(self) -> tuple[bool, bool]:
        trigger = bool(self.cfg.trigger_file and os.path.exists(self.cfg.trigger_file))
        rows = exchange_in_group([float(self._sigterm), float(self._requested or trigger)])
        return any(r[0] for r in rows), any(r[1] for r in rows)

    def _after_step(self, committed: bool) -> None:
        if self._grace is not None:  # the step finished: the group can save and stop in order
            self._grace.cancel()
        stopping, requested = self._agree()
        m = self.engine.manager
        step = m.current_step
        if (committed and step != self._last_saved and save_due(step, self.cfg.every, requested=requested,
                                                                 stopping=stopping)
                and is_writer(m.replica_rank, committed)):
            self.save(step)
            if requested:
                self._requested = False
                if dist.get_rank() == 0 and self.cfg.trigger_file:
                    try:
                        os.remove(self.cfg.trigger_file)
                    except FileNotFoundError:
                        pass
        if stopping:
            self.stopping = True
            self.log.warning("SIGTERM: stopping after step %d", step)

    # -- save --------------------------------------------------------------
    def save(self, step: int) -> None:
        """Write the state after committed ``step``; all ranks of the group call it (the caller picks the writer)."""
        e, m = self.engine, self.engine.manager
        meta = self.metadata(step)
        rank_state = e.replica_state()

        def published(info: Dict[str, Any]) -> None:
            e.events.write(event="checkpoint_saved", time=time.time(), step=step, quorum_id=m.quorum_id,
                           asynchronous=self.writer is not None, **info)
            self.log.info("checkpoint %s published (%s bytes)", info.get("path"), info.get("total_bytes"))

        res = save_group_checkpoint(
            e.engine, self.store, step, quorum_id=m.quorum_id, metadata=meta, rank_state=rank_state,
            keep=self.cfg.keep, writer=self.writer,
            on_published=published, publish_timeout_s=self.cfg.publish_timeout_s, log=self.log)
        self._last_saved = step
        self.saves.append(res)
        e.events.write(event="checkpoint_stall", time=time.time(), step=step, stall_s=res.stall_s,
                       asynchronous=self.writer is not None)

    def metadata(self, step: int) -> Dict[str, Any]:
        """``ftbridge.json`` for a checkpoint of ``step`` taken now."""
        e, m, cfg = self.engine.engine, self.engine.manager, self.engine.cfg
        from importlib.metadata import PackageNotFoundError, version

        def ver(name: str) -> str:
            try:
                return version(name)
            except PackageNotFoundError:
                return "?"
        param = next(e.module.parameters())
        participants = m.participants
        return {
            "format": FORMAT, "step": step, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "group_size": cfg.group_size, "zero_stage": self.engine.adapter.stage,
            "dtypes": {"params": str(param.dtype), "grad_accum": str(e.get_data_types()[1])},
            "versions": {"ftbridge": ver("ftbridge"), "deepspeed": deepspeed.__version__,
                         "torch": str(torch.__version__), "torchft": ver("torchft"),
                         "python": platform.python_version()},
            "quorum": {"quorum_id": m.quorum_id, "participants": participants, "replica_rank": m.replica_rank,
                       "replica_group_id": cfg.replica_group_id},
            "manager": m.state_dict(),
            "engine_counters": {k: int(getattr(e, k)) for k in
                                ("global_steps", "global_samples", "skipped_steps", "micro_steps")},
            "slots": cfg.slots,
            "data_position": {"step": int(e.global_steps), "micro_steps": int(e.micro_steps),
                              "dp_world_size": (cfg.slots or participants) * cfg.group_size,
                              "rule": "batch = f(seed, step, micro, dp_rank, dp_world_size), dp_rank = "
                                      + ("slot" if cfg.slots else "replica_rank_in_job")
                                      + " * group_size + group_rank"},
            "asynchronous": self.writer is not None,
        }

    def close(self) -> None:
        """Wait for a background write to finish."""
        if self.writer is not None:
            self.writer.wait()

    # -- resume ------------------------------------------------------------
    def resume(self) -> Optional[int]:
        """Load the newest valid checkpoint into this group; every group rank calls it before training.

        A checkpoint any rank finds damaged is skipped for the next older one.

        Returns:
            The step loaded, or ``None`` when the folder holds no checkpoint.

        Raises:
            NoValidCheckpointError: checkpoints exist but none verifies.
            UnsafeCheckpointError: a file needs a type outside the allowlist (named); nothing was loaded.
            GroupSizeMismatchError: saved by groups of another size; before any state changes.
            SlotsMismatchError: saved with other ``slots`` and :attr:`CheckpointConfig.allow_other_slots` off.
        """
        damaged: List[int] = []
        while True:
            error = None
            if dist.get_rank() == 0:
                code, step, error = self._choose(damaged)
            else:
                code, step = CHOICE_NONE, 0
            code, step = broadcast_choice(code, step)
            if code == CHOICE_NONE:
                self.log.info("no checkpoint in %s: starting from step 0", self.cfg.dir)
                return None
            if code != CHOICE_OK:
                raise NoValidCheckpointError(error or f"group rank 0 found no valid checkpoint in {self.cfg.dir}; "
                                             "its log lists the problems")
            try:
                return self._load(next(c for c in self.store.list() if c.step == step))
            except CorruptFileError as e:
                self.log.warning("checkpoint at step %d cannot be trusted, trying an older one: %s", step, e)
                damaged.append(step)

    def _load(self, ckpt: CheckpointInfo) -> int:
        meta = ckpt.metadata()  # hashed against the manifest, then parsed
        check_compatible(meta, ckpt.path, group_size=self.engine.cfg.group_size, zero_stage=self.engine.adapter.stage,
                         slots=None if self.cfg.allow_other_slots else self.engine.cfg.slots)
        t = time.perf_counter()
        rank_state = load_group_checkpoint(self.engine.engine, ckpt)
        self._apply(meta, rank_state)
        load_s = time.perf_counter() - t
        self._last_saved = ckpt.step
        self.engine.events.write(event="checkpoint_loaded", time=time.time(), step=ckpt.step, path=ckpt.path,
                                 load_s=load_s, saved_by=meta.get("quorum", {}).get("replica_group_id"),
                                 param_checksum=tensor_checksum(self.engine.adapter.full_parameters()))
        self.log.info("resumed from %s (step %d) in %.2f s", ckpt.path, ckpt.step, load_s)
        return ckpt.step

    def _choose(self, damaged: List[int]) -> Tuple[int, int, Optional[str]]:
        try:
            ckpt = self.store.find_valid(self.log, hash_torch_files=False, skip=damaged)
        except NoValidCheckpointError as e:
            return CHOICE_INVALID, 0, str(e)
        if ckpt is None:
            return CHOICE_NONE, 0, None
        return CHOICE_OK, ckpt.step, None

    def _apply(self, meta: Dict[str, Any], rank_state: Dict[str, Any]) -> None:
        # A fresh accumulation window, whatever gradient_accumulation_steps the checkpoint was saved with;
        # torchft's counters from ftbridge.json where a rank file predates replica_state's "manager".
        self.engine.load_replica_state({"manager": meta["manager"], **rank_state})


CHOICE_NONE, CHOICE_OK, CHOICE_INVALID = 0, 1, 2
"""Resume choices broadcast by group rank 0: no checkpoint, load step N, none valid."""


def broadcast_choice(code: int, step: int) -> Tuple[int, int]:
    """Group rank 0's ``(code, step)`` (a ``CHOICE_*`` value and the step for ``CHOICE_OK``) on every rank of the
    group, as a tensor (no pickle)."""
    first = exchange_in_group([float(code), float(step)])[0]
    return int(first[0]), int(first[1])


def add_arguments(parser: Any) -> None:
    """Add the checkpoint flags to a training script's ``argparse`` parser."""
    g = parser.add_argument_group("checkpoints (fixed-size replica-group checkpoints)")
    g.add_argument("--checkpoint-dir", default=None, help="checkpoint folder shared by all replica groups")
    g.add_argument("--checkpoint-every", type=int, default=0,
                   help="save every N committed steps (0: only on demand and on SIGTERM)")
    g.add_argument("--keep-checkpoints", type=int, default=3, help="keep the newest K checkpoints (0: all)")
    g.add_argument("--checkpoint-async", action="store_true",
                   help="snapshot to CPU at the step boundary and write in the background")
    g.add_argument("--resume", action="store_true",
                   help="load the newest valid checkpoint of --checkpoint-dir on start-up (none: start at step 0)")
    g.add_argument("--checkpoint-trigger", default=None,
                   help="save after the next step once this file exists (default <checkpoint-dir>/SAVE_NOW)")
    g.add_argument("--resume-other-slots", action="store_true",
                   help="resume a checkpoint saved with other slots (FTBRIDGE_SLOTS); refused by default, since the "
                        "global batch and the rows of every later step change")
    g.add_argument("--checkpoint-key-file", default=os.environ.get("FTBRIDGE_CKPT_KEY_FILE"), metavar="FILE",
                   help="sign manifests with the key in FILE (outside the checkpoint folder) and trust only signed "
                        "ones (default $FTBRIDGE_CKPT_KEY_FILE)")


def config_from_args(args: Any) -> CheckpointConfig:
    """:class:`CheckpointConfig` from the flags of :func:`add_arguments`."""
    return CheckpointConfig(dir=args.checkpoint_dir, every=args.checkpoint_every, keep=args.keep_checkpoints,
                            asynchronous=args.checkpoint_async, trigger_file=args.checkpoint_trigger,
                            key_file=args.checkpoint_key_file, allow_other_slots=args.resume_other_slots)
