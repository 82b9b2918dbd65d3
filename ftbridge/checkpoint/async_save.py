"""Snapshot at the step boundary, write in the background.

:class:`SnapshotCheckpointEngine` is the ``save`` ftbridge plugs into DeepSpeed's checkpoint engine:
sync, it writes and fsyncs at once; async, it queues a CPU :func:`snapshot` that
:class:`BackgroundWriter` writes later. Files are DeepSpeed's own either way (``docs/checkpoints.md``,
"How it works": Async).
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ftbridge.staging import host_copy, synchronize

logger = logging.getLogger(__name__)


def snapshot(obj: Any, memo: Optional[Dict[Tuple[int, int, str], Any]] = None) -> Any:
    """A CPU copy of a nested state dict (any device) that later training cannot change.

    Storage sharing is kept (same offsets and strides), so ``torch.save`` of it writes the same bytes as
    of ``obj``; other leaves are deep-copied where possible; GPU storages go through pinned memory.
    """
    top = memo is None
    memo = {} if memo is None else memo
    out = _snapshot(obj, memo)
    if top:  # the non-blocking device-to-host copies are complete from here on
        for device in {key[2] for key in memo if not key[2].startswith("cpu")}:
            synchronize(torch.device(device))
    return out


def _snapshot(obj: Any, memo: Dict[Tuple[int, int, str], Any]) -> Any:
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes(), str(storage.device))
        copied = memo.get(key)
        if copied is None:
            copied = storage.clone() if storage.device.type == "cpu" else host_copy(storage)
            memo[key] = copied
        out = torch.empty(0, dtype=obj.dtype)
        out.set_(copied, obj.storage_offset(), obj.size(), obj.stride())
        return out
    if isinstance(obj, dict):
        new = type(obj)((k, _snapshot(v, memo)) for k, v in obj.items())
        # Keep attributes of dict subclasses: a module state dict's ``_metadata`` (per-module versions).
        for name, value in getattr(obj, "__dict__", {}).items():
            setattr(new, name, _snapshot(value, memo))
        return new
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_snapshot(v, memo) for v in obj)
    try:
        return copy.deepcopy(obj)
    except Exception:  # noqa: BLE001 - an object that cannot be copied is saved as it is at write time
        return obj


class _HashingFile:
    """Write-only file wrapper that hashes the bytes as they pass."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.sha.update(view)
        self.size += view.nbytes
        return self.f.write(view)

    def flush(self) -> None:
        self.f.flush()


def write_state(state: Any, path: str, zipfile_serialization: bool = True) -> Dict[str, Any]:
    """Write ``state`` with ``torch.save`` into ``path``, flush and fsync; returns ``{"bytes": n, "sha256": hex}``."""
    with open(path, "wb") as f:
        hf = _HashingFile(f)
        # torch.save takes any object with write(); its stub asks for IO[bytes].
        torch.save(state, hf, _use_new_zipfile_serialization=zipfile_serialization)  # type: ignore[arg-type]
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": hf.size, "sha256": hf.sha.hexdigest()}


class SnapshotCheckpointEngine:
    """The ``save`` of a DeepSpeed checkpoint engine: write now, or (``asynchronous``) snapshot and queue.

    ``zipfile_serialization``: the engine's own ``torch.save`` format, so files match a DeepSpeed save.
    """

    def __init__(self, *, asynchronous: bool, zipfile_serialization: bool = True) -> None:
        self.asynchronous = asynchronous
        self.zipfile_serialization = zipfile_serialization
        self.pending: List[Tuple[Any, str]] = []
        self.written: Dict[str, Dict[str, Any]] = {}
        """``{path: {"bytes", "sha256"}}`` of every file this engine wrote."""

    def save(self, state_dict: Any, path: str) -> None:
        """Write ``state_dict`` to ``path`` now, or queue a CPU snapshot of it."""
        if self.asynchronous:
            self.pending.append((snapshot(state_dict), path))
        else:
            self.written[path] = write_state(state_dict, path, self.zipfile_serialization)

    def take(self) -> List[Tuple[Any, str]]:
        """The queued ``(snapshot, path)`` pairs, emptying the queue."""
        pending, self.pending = self.pending, []
        return pending

    def write_pending(self, pending: List[Tuple[Any, str]]) -> int:
        """Write queued snapshots; returns the bytes written."""
        total = 0
        for state, path in pending:
            self.written[path] = write_state(state, path, self.zipfile_serialization)
            total += self.written[path]["bytes"]
        return total


class BackgroundWriter:
    """Runs one checkpoint write at a time in a daemon thread.

    A failed write is logged and kept in :attr:`last_error`; it never stops training (nothing is published).
    """

    def __init__(self) -> None:
        self._thread: Optional[threading.Thread] = None
        self.last_error: Optional[BaseException] = None
        self.waited_s = 0.0

    def busy(self) -> bool:
        """Whether a write is still running."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout_s: Optional[float] = None) -> float:
        """Wait for the running write; returns the seconds waited.

        Raises:
            TimeoutError: still running after ``timeout_s``.
        """
        t = time.perf_counter()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise TimeoutError(f"checkpoint write still running after {timeout_s} s")
            self._thread = None
        waited = time.perf_counter() - t
        self.waited_s += waited
        return waited

    def submit(self, fn: Callable[[], None]) -> float:
        """Run ``fn`` in the background once the previous write finished; returns the seconds waited for it."""
        waited = self.wait()

        def run() -> None:
            try:
                fn()
            except BaseException as e:
                self.last_error = e
                logger.error("background checkpoint write failed: %r", e, exc_info=True)

        self._thread = threading.Thread(target=run, name="ftbridge-ckpt-writer", daemon=True)
        self._thread.start()
        return waited
