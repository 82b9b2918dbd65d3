"""Logging with identity: every line says which replica group, rank and step.

Format: ``2026-11-29 21:40:01 INFO [replica 1 rank 0 step 42] committed ...``.
Group rank 0 logs at INFO, the other ranks at WARNING (one rank per group by
default); ``FTBRIDGE_LOG_LEVEL`` overrides the level on every rank.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Callable, MutableMapping, Optional, Tuple

FORMAT = "%(asctime)s %(levelname)s %(message)s"


class _IdentityAdapter(logging.LoggerAdapter):
    def __init__(self, logger: logging.Logger, replica_group: int, group_rank: int,
                 step_fn: Optional[Callable[[], int]]) -> None:
        super().__init__(logger, {})
        self._who = f"replica {replica_group} rank {group_rank}"
        self._step_fn = step_fn

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> Tuple[Any, MutableMapping[str, Any]]:
        step = ""
        if self._step_fn is not None:
            try:
                step = f" step {self._step_fn()}"
            except Exception:  # noqa: BLE001 - the step may not exist yet during start-up
                step = ""
        return f"[{self._who}{step}] {msg}", kwargs


LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level(raw: Optional[str], group_rank: int = 0) -> str:
    """The log level ``FTBRIDGE_LOG_LEVEL=raw`` selects (any case), else INFO on group rank 0 and WARNING elsewhere.

    Raises:
        ValueError: ``raw`` is not one of :data:`LEVELS`, naming the variable and the choices.
    """
    if not raw:
        return "INFO" if group_rank == 0 else "WARNING"
    level = raw.strip().upper()
    if level not in LEVELS:
        raise ValueError(f"FTBRIDGE_LOG_LEVEL={raw!r} is not a log level; set it to one of {', '.join(LEVELS)} "
                         "(any case) or unset it")
    return level


def setup_logging(group_rank: int) -> None:
    """Configure the root logger once per process (idempotent).

    Raises:
        ValueError: ``FTBRIDGE_LOG_LEVEL`` is set to something else than a level (:func:`log_level`).
    """
    root = logging.getLogger()
    if getattr(root, "_ftbridge_configured", False):
        return
    level = log_level(os.environ.get("FTBRIDGE_LOG_LEVEL"), group_rank)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT, "%Y-%m-%d %H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(level)
    root._ftbridge_configured = True  # type: ignore[attr-defined]
    # torchft's structured quorum/commit loggers print empty lines; ftbridge's event log carries the same.
    for name in ("torchft_quorums", "torchft_commits", "torchft_errors"):
        logging.getLogger(name).setLevel(logging.ERROR)
    if "FTBRIDGE_LOG_LEVEL" not in os.environ:
        logging.getLogger("torchft").setLevel(logging.WARNING)
    logging.getLogger("torchft.manager").addFilter(_NoFlightRecorderNoise())


class _NoFlightRecorderNoise(logging.Filter):
    """Drops torchft's "Unable to reset NCCL flight recorder recording" warning, logged at every quorum change by a
    torch built without NCCL (CPU builds), where there is no such recording to reset."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Unable to reset NCCL flight recorder" not in record.getMessage() or _has_flight_recorder()


def _has_flight_recorder() -> bool:
    import torch

    return hasattr(torch._C._distributed_c10d, "_reset_fr_recording_nccl")


def get_logger(name: str, cfg: Any, step_fn: Optional[Callable[[], int]] = None) -> logging.LoggerAdapter:
    """A logger whose lines carry ``[replica G rank R step S]``.

    Args:
        name: logger name.
        cfg: an object with ``replica_group_id`` and ``group_rank``.
        step_fn: returns the current step, or ``None`` to omit it.
    """
    setup_logging(cfg.group_rank)
    return _IdentityAdapter(logging.getLogger(name), cfg.replica_group_id, cfg.group_rank, step_fn)


class RepeatLimit:
    """At most one line per ``every_s`` for a message that can repeat every step (a link that flaps).

    ``allow(key, now)`` returns ``None`` for a line to hold back, else how many lines of ``key`` were
    held back since the last one logged (add it to the line: nothing is hidden without a count).

    Args:
        every_s: seconds between two lines of one key.
    """

    def __init__(self, every_s: float = 30.0) -> None:
        self.every_s = every_s
        self._last: dict = {}  # key -> (monotonic time logged, lines held back since)

    def allow(self, key: str, now: float) -> Optional[int]:
        logged, held = self._last.get(key, (None, 0))
        if logged is not None and now - logged < self.every_s:
            self._last[key] = (logged, held + 1)
            return None
        self._last[key] = (now, 0)
        return held
