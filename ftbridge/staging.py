"""Moving GPU tensors to and from bytes through one bucket-sized pinned host buffer (:class:`Staging`).

For the heal transport (:class:`ftbridge.heal.stream.StreamBody` on the donor,
:func:`ftbridge.heal.stream.read_tensors` on a GPU joiner) and, with :func:`host_copy` then
:func:`synchronize`, for async checkpoints. Why: docs/gpu.md, "What the GPU code does".
"""

from __future__ import annotations

import threading
from typing import Any, Callable, List, Optional, cast

import torch

DEFAULT_STAGING_BYTES = 32 << 20
"""Bytes of the pinned staging buffer unless told otherwise (one cross-replica bucket is 25 MiB)."""


def staging_size(tensor_bytes: List[int], cap_bytes: int = DEFAULT_STAGING_BYTES) -> int:
    """Buffer bytes for GPU tensors of ``tensor_bytes``: ``min(max(tensor_bytes), cap_bytes)`` up to 4 KiB, or 0.

    Raises ``ValueError`` when ``cap_bytes`` is not positive.
    """
    if cap_bytes <= 0:
        raise ValueError(f"cap_bytes={cap_bytes} must be positive")
    largest = max((int(n) for n in tensor_bytes), default=0)
    if largest <= 0:
        return 0
    return min(-(-min(largest, cap_bytes) // 4096) * 4096, -(-cap_bytes // 4096) * 4096)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a 1-D uint8 view (no copy)."""
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


class Staging:
    """One reusable host buffer of ``nbytes`` for chunked device <-> host copies (thread-safe by a lock).

    Args:
        nbytes: buffer size, bytes (> 0); allocated on first use.
        pin: pin it (default: when CUDA is available).
    """

    def __init__(self, nbytes: int = DEFAULT_STAGING_BYTES, pin: Optional[bool] = None) -> None:
        if nbytes <= 0:
            raise ValueError(f"staging buffer of {nbytes} bytes: give a positive size")
        self.nbytes = int(nbytes)
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.lock = threading.Lock()
        """Held by the user of the buffer for a whole body (one body at a time)."""
        self._buf: Optional[torch.Tensor] = None
        self.chunks_moved = 0
        """Chunks copied through the buffer so far."""
        self.stage_cpu = False
        """Testing: move CPU tensors through the buffer too, exactly as device tensors are."""

    def buffer(self) -> torch.Tensor:
        """The 1-D uint8 host buffer."""
        if self._buf is None:
            self._buf = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=self.pin)
        return self._buf

    def moves(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s bytes go through this buffer: a device tensor (or any, with ``stage_cpu``)."""
        return tensor.device.type != "cpu" or self.stage_cpu

    def to_host(self, flat: torch.Tensor) -> memoryview:
        """A view of the buffer holding ``flat``'s bytes (1-D uint8, at most ``nbytes``), the copy completed.

        The view is valid until the next use of the buffer; hold :attr:`lock` across both.

        Raises:
            ValueError: ``flat`` is longer than the buffer.
        """
        n = flat.numel()
        if n > self.nbytes:
            raise ValueError(f"{n} bytes do not fit the {self.nbytes}-byte staging buffer: copy in pieces")
        buf = self.buffer()
        buf[:n].copy_(flat, non_blocking=self.pin)
        synchronize(flat.device)
        self.chunks_moved += 1
        return _bytes_view(buf[:n])

    def fill(self, tensor: torch.Tensor, read_into: Callable[[memoryview], int]) -> int:
        """Fill contiguous ``tensor`` from ``read_into(view) -> n`` (``readinto``); the bytes filled (fewer: EOF)."""
        flat = _as_bytes(tensor)
        got = 0
        if not self.moves(tensor):
            return read_full(read_into, _bytes_view(flat)) if flat.numel() else 0
        buf = self.buffer()
        for start in range(0, flat.numel(), self.nbytes):
            n = min(self.nbytes, flat.numel() - start)
            k = read_full(read_into, _bytes_view(buf[:n]))
            flat[start:start + k].copy_(buf[:k], non_blocking=self.pin)
            synchronize(tensor.device)  # the buffer is read again for the next chunk
            self.chunks_moved += 1
            got += k
            if k < n:
                break
        return got


def _bytes_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU uint8 tensor's memory (no copy)."""
    return memoryview(cast(Any, t.numpy())).cast("B")


def read_full(read_into: Callable[[memoryview], int], view: memoryview) -> int:
    """Fill ``view`` by repeated ``read_into`` calls; the bytes filled (fewer only at EOF)."""
    got = 0
    while got < len(view):
        k = read_into(view[got:])
        if not k:
            break
        got += k
    return got


def synchronize(device: torch.device) -> None:
    """Wait for the copies enqueued on ``device``'s current stream (nothing on the CPU)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def host_copy(storage: Any, pin: Optional[bool] = None) -> Any:
    """A pinned host copy of a device ``torch.UntypedStorage``, complete after :func:`synchronize`."""
    pin = torch.cuda.is_available() if pin is None else pin
    src = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    dst = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
    dst.copy_(src, non_blocking=pin)
    return dst.untyped_storage()


__all__ = ["DEFAULT_STAGING_BYTES", "Staging", "host_copy", "read_full", "staging_size", "synchronize"]
