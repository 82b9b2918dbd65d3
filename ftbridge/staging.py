"""Moving GPU tensors to and from bytes through one bucket-sized pinned host buffer (:class:`Staging`).

For the heal transport: :func:`staged_body` (donor) and :func:`read_tensors` (joiner), in the bytes of
:func:`ftbridge.heal.wire.encode_state`, so either side may stage or not. For async checkpoints:
:func:`host_copy`, then :func:`synchronize`. Why: docs/gpu.md, "What the GPU code does".
"""

from __future__ import annotations

import struct
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, cast

import torch

from ftbridge.heal.wire import ST_MAX_HEADER_BYTES, BodyPlan, blob_entries, plan_body

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

    def chunks(self, tensor: torch.Tensor) -> Iterator[memoryview]:
        """The bytes of ``tensor`` in order, through the buffer (a CPU tensor: one view); each valid until the next."""
        t = tensor.detach()
        if t.device.type == "cpu" and not self.stage_cpu:
            flat = _as_bytes(t.contiguous())
            if flat.numel():
                yield _bytes_view(flat)
            return
        flat = _as_bytes(t.contiguous())
        buf = self.buffer()
        for start in range(0, flat.numel(), self.nbytes):
            n = min(self.nbytes, flat.numel() - start)
            buf[:n].copy_(flat[start:start + n], non_blocking=self.pin)
            synchronize(t.device)
            self.chunks_moved += 1
            yield _bytes_view(buf[:n])

    def fill(self, tensor: torch.Tensor, read_into: Callable[[memoryview], int]) -> int:
        """Fill contiguous ``tensor`` from ``read_into(view) -> n`` (``readinto``); the bytes filled (fewer: EOF)."""
        flat = _as_bytes(tensor)
        got = 0
        if tensor.device.type == "cpu" and not self.stage_cpu:
            return _read_full(read_into, _bytes_view(flat)) if flat.numel() else 0
        buf = self.buffer()
        for start in range(0, flat.numel(), self.nbytes):
            n = min(self.nbytes, flat.numel() - start)
            k = _read_full(read_into, _bytes_view(buf[:n]))
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


def _read_full(read_into: Callable[[memoryview], int], view: memoryview) -> int:
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


# -- the heal body -----------------------------------------------------------------------------------
class StagedBody:
    """A heal body (:mod:`ftbridge.heal.wire` layout) whose tensor bytes are written from the tensors themselves.

    Args:
        plan: the body laid out by :func:`ftbridge.heal.wire.plan_body` (its prefix, then each tensor's bytes).
        staging: the buffer device tensors pass through.
    """

    def __init__(self, plan: BodyPlan, staging: Staging) -> None:
        self.prefix, self.size, self.staging = plan.prefix, plan.size, staging
        self.tensors = tuple(t.detach().contiguous() for t in plan.tensors)  # views sharing storage: written twice

    def __len__(self) -> int:
        return self.size

    def write_to(self, write: Callable[[Any], Any], at_half: Optional[Callable[[], None]] = None) -> None:
        """Write the body with ``write(bytes_like)``; ``at_half()`` once about half of it went (fault tests)."""
        half, sent = len(self) // 2, 0
        with self.staging.lock:
            write(self.prefix)
            sent = len(self.prefix)
            for t in self.tensors:
                for view in self.staging.chunks(t):
                    write(view)
                    before, sent = sent, sent + len(view)
                    if at_half is not None and before < half <= sent:
                        at_half()
                        at_half = None
        if at_half is not None:
            at_half()


def staged_body(state: Dict[str, Any], staging: Staging, force: bool = False) -> Optional[StagedBody]:
    """:class:`StagedBody` of ``state`` when it holds a GPU tensor (or ``force``); ``None``: encode it whole.

    ``None`` also for a dtype :func:`ftbridge.heal.wire.plan_body` does not lay out. Raises ``TypeError`` as
    :func:`ftbridge.heal.wire.encode_state`.
    """
    plan = plan_body(state)
    if plan is None or not (force or any(t.device.type != "cpu" for t in plan.tensors)):
        return None
    return StagedBody(plan, staging)


def read_tensors(read_into: Callable[[memoryview], int], size: int, device: torch.device,
                 staging: Staging) -> Dict[str, torch.Tensor]:
    """Read the safetensors part of a heal body (``size`` bytes) into new tensors on ``device``.

    The header is checked as :mod:`ftbridge.heal.wire` checks it before any allocation: at most ``size`` bytes.

    Raises:
        ValueError: a malformed or truncated header, or a dtype outside the wire format.
        ConnectionError: the body ended inside a tensor.
    """
    prefix = bytearray(8)
    if size < 8 or _read_full(read_into, memoryview(prefix)) != 8:
        raise ValueError(f"heal state tensor blob of {size} bytes is truncated")
    (n,) = struct.unpack("<Q", prefix)
    if n > min(ST_MAX_HEADER_BYTES, size - 8):
        raise ValueError(f"safetensors header of {n} bytes does not fit a blob of {size} bytes")
    raw = bytearray(n)
    if _read_full(read_into, memoryview(raw)) != n:
        raise ValueError("safetensors header is truncated")
    entries = blob_entries(bytes(raw), size - 8 - n)
    out: Dict[str, torch.Tensor] = {}
    with staging.lock:
        for name, dtype, shape, begin, end in entries:
            t = torch.empty(shape, dtype=dtype, device=device)
            if staging.fill(t, read_into) != end - begin:
                raise ConnectionError(f"heal state ended inside tensor {name!r} (the donor died?)")
            out[name] = t
    return out


__all__ = ["DEFAULT_STAGING_BYTES", "StagedBody", "Staging", "host_copy", "read_tensors", "staged_body",
           "staging_size", "synchronize"]
