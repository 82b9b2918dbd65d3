"""Structured per-step event log (JSON lines) and parameter checksums.

One line per rank per optimizer step, written by the engine wrapper; tests,
plots and the chaos report read it back with :func:`read_events`. Fields::

    time            float  seconds since the epoch, after the step
    replica_group   int    replica group id
    group_rank      int    rank inside the replica group
    pid             int    the writing process (a warm spare that took the group's id, and the paused
                           group it replaced, may write one log at the same time)
    step            int    manager step after the step (committed steps so far)
    quorum_id       int    torchft quorum id of the step
    participants    int    replica groups that took part in the step
    replica_rank    int|None  rank of this group in the quorum (None: healing)
    committed       bool   the optimizer step was applied
    healed          bool   this rank received a peer's state during the step
    loss            float|None  mean training loss over the step's micro-batches
    step_time_s     float  wall time of the step (first forward to step end)
    param_checksum  str|None    SHA-256 (first 16 hex digits) of the parameters

Extra keys may be added by callers (``event`` for non-step events such as
``"start"`` or ``"validation"``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch

logger = logging.getLogger(__name__)


def tensor_checksum(tensors: Iterable[torch.Tensor]) -> str:
    """SHA-256 over the raw bytes of ``tensors`` in order (any dtype, shape, device; each copied to
    contiguous CPU): 16 lowercase hex digits, equal for bit-identical tensors.
    """
    h = hashlib.sha256()
    for tensor in tensors:
        t = tensor.detach().to("cpu").contiguous()
        h.update(str(t.dtype).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


class EventLog:
    """Append-only JSON-lines writer, flushed after every record.

    Args:
        path: file to append to; parent folders are created. ``None`` makes every call a no-op.
        identity: fields added to every record (e.g. replica_group, group_rank).
    """

    def __init__(self, path: Optional[str], identity: Optional[Dict[str, Any]] = None) -> None:
        self.path = path
        self._identity = dict(identity or {})
        self._lock = threading.Lock()
        self._file = None
        self._listeners: List[Callable[[Dict[str, Any]], None]] = []
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._file = open(path, "a", buffering=1, encoding="utf-8")
            # A previous process killed mid-write may have left a torn last line: end it.
            if self._file.tell() > 0:
                with open(path, "rb") as f:
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":
                        self._file.write("\n")

    def add_listener(self, listener: Callable[[Dict[str, Any]], None]) -> None:
        """Call ``listener(record)`` with every record written from now on, with or without a file, in the
        writer's thread; a listener's exception is logged once and never reaches the writer.
        """
        self._listeners.append(listener)

    def write(self, **fields: Any) -> None:
        """Append one record: identity fields, then ``fields``; then tell the listeners."""
        if self._file is None and not self._listeners:
            return
        record = {**self._identity, **fields}
        if self._file is not None:
            with self._lock:
                self._file.write(json.dumps(record) + "\n")
                self._file.flush()
        for listener in list(self._listeners):
            try:
                listener(record)
            except Exception:  # a metrics bug must not stop training
                self._listeners.remove(listener)
                logger.exception("event listener %r failed and was removed", listener)

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None


def read_events(paths: Iterable[str]) -> List[Dict[str, Any]]:
    """Read and merge JSON-lines event logs, sorted by ``time``; a torn last line (a process killed
    mid-write) is skipped.
    """
    out: List[Dict[str, Any]] = []
    for path in paths:
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            for raw in f:
                line = raw.strip()
                if not line:
                    continue
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    out.sort(key=lambda r: r.get("time", 0.0))
    return out
