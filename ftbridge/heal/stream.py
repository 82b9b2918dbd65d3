"""The donor's heal body, sent from its live tensors while they may not change; the joiner's receive memory.

:class:`StreamBody` sends the bytes of :func:`ftbridge.heal.wire.encode_state` from the tensors until
:meth:`StreamBody.freeze`, then from a copy: a host tensor's bytes straight from its memory, a device
tensor's through one pinned :class:`ftbridge.staging.Staging` buffer, chunk by chunk. Precondition: a heal
state's tensors are not written between torchft's ``send_checkpoint`` and ``disallow_checkpoint`` (which
calls ``freeze``). Why this is a consistent snapshot: ``docs/heal.md``, "Streaming the body".
:class:`ReceiveBuffer` and :func:`read_tensors` are the joiner's memory: host, or device through staging.
"""

from __future__ import annotations

import bisect
import mmap
import struct
import threading
import time
from contextlib import nullcontext
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch

from ftbridge.heal.wire import ST_MAX_HEADER_BYTES, BodyPlan, blob_entries, tensor_bytes
from ftbridge.staging import Staging, read_full

SEND_CHUNK_BYTES = 32 << 20
"""Most bytes written from the live state in one write: bounds how long :meth:`StreamBody.freeze` waits."""
FREEZE_GRACE_S = 1.0
"""Seconds :meth:`StreamBody.freeze` waits for a write from the live state before cutting that response off."""
PAGE_BYTES = 4096


MAX_IOVECS = 512
"""Most buffers passed to one ``sendmsg`` (Linux allows 1024)."""

Segment = Union[memoryview, torch.Tensor]
"""A tensor's bytes in the body: a host view, or a flat uint8 device tensor sent through staging."""


def _send_all(send: Callable[[List[Any]], int], views: List[memoryview]) -> int:
    """Send every byte of ``views`` with ``send`` (which may send only some); returns their total."""
    total, views = sum(len(v) for v in views), [v for v in views if len(v)]
    left = total
    while views:
        n = send(views)
        if n <= 0:
            raise ConnectionError("heal transport: the connection accepted no more bytes")
        left -= n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]
    return total


class BodyAborted(Exception):
    """The body can no longer be sent: the donor's state may have changed before this response got its bytes."""


def _segment(t: torch.Tensor, staging: Optional[Staging]) -> Segment:
    """``t``'s bytes: a flat uint8 tensor where ``staging`` moves them (device tensors), else a host view."""
    if staging is not None and staging.moves(t):
        return t.detach().contiguous().reshape(-1).view(torch.uint8)
    flat = tensor_bytes(t)
    return flat.numpy().data if flat.numel() else memoryview(b"")


class StreamBody:
    """One heal body: a prefix, then each tensor's bytes, sent from the tensors until :meth:`freeze`.

    Args:
        plan: the layout (:func:`ftbridge.heal.wire.plan_body`), whose live tensors are read while
            responses are served, or a whole encoded body (``bytes``).
        staging: the pinned buffer device tensors are copied through, at most ``staging.nbytes`` at a time;
            one response uses it at a time (its lock is held for the response). Required when ``plan`` holds
            a device tensor.

    ``size``: bytes of the body.

    Raises:
        ValueError: ``plan`` holds a device tensor and no ``staging`` was given.
    """

    def __init__(self, plan: Union[BodyPlan, bytes], staging: Optional[Staging] = None) -> None:
        self._cond = threading.Condition()
        self._staging = staging
        if isinstance(plan, BodyPlan):
            if staging is None and any(t.device.type != "cpu" for t in plan.tensors):
                raise ValueError("a heal body with device tensors needs a staging buffer (staging=Staging())")
            self._prefix, self.size = plan.prefix, plan.size
            self._segments: Optional[List[Segment]] = [_segment(t, staging) for t in plan.tensors]
        else:
            self._prefix, self.size, self._segments = bytes(plan), len(plan), []
        self._starts = [0]
        for seg in self._segments:
            self._starts.append(self._starts[-1] + _length(seg))
        self._staged_segments = any(isinstance(seg, torch.Tensor) for seg in self._segments)
        self._data_size = self.size - len(self._prefix)
        self._frozen = False
        self._pins = 0  # reads of the live state in progress
        self._senders: Dict[int, List[Any]] = {}  # id -> [bytes of the data sent, cut-off callback]
        self._kept: Optional[memoryview] = None
        self._kept_from = self._data_size
        self.staged_bytes = 0
        """Bytes :meth:`freeze` copied for responses still in flight (0: none were)."""

    def _next_views(self, off: int, room: int) -> Tuple[List[Segment], bool]:
        """``(pieces of the data from off, live)``, at most ``room`` bytes in all; caller holds the lock.

        A piece from a device tensor comes alone, at most one staging buffer long.
        """
        if off >= self._kept_from and self._kept is not None:
            a = off - self._kept_from
            return [self._kept[a : a + room]], False
        if self._frozen or self._segments is None:
            raise BodyAborted("the donor's state may change now, and the rest of this response was not kept")
        i = bisect.bisect_right(self._starts, off) - 1
        pieces: List[Segment] = []
        while i < len(self._segments) and room > 0 and len(pieces) < MAX_IOVECS:
            seg, a = self._segments[i], max(off - self._starts[i], 0)
            if isinstance(seg, torch.Tensor):
                if pieces:
                    break
                assert self._staging is not None
                return [seg[a : a + min(room, self._staging.nbytes)]], True
            view = seg[a : a + room]
            if len(view):
                pieces.append(view)
                room -= len(view)
            i += 1
        return pieces, True

    def serve(self, send: Callable[[List[Any]], int], cut: Callable[[], None], head: bytes = b"",
              halfway: Optional[Callable[[], None]] = None) -> int:
        """Send ``head`` and the whole body with ``send``; returns the body bytes sent (``size``).

        Args:
            send: sends some of a list of bytes-like objects and returns how many bytes (``socket.sendmsg``).
            cut: makes a blocked ``send`` fail at once (shuts the socket down); :meth:`freeze` calls it.
            head: bytes sent first, with the body's prefix (the HTTP response headers).
            halfway: called once half of the body is sent (fault injection, ``faults.point("heal_send")``).

        Raises:
            BodyAborted: the state was frozen before this response could keep its remaining bytes.
            OSError: from ``send``.
        """
        key = id(cut)
        with self._cond:
            self._senders[key] = [0, cut]
        try:
            staging_lock = self._staging.lock if self._staged_segments and self._staging else nullcontext()
            with staging_lock:
                return self._serve(send, key, head, halfway)
        finally:
            with self._cond:
                del self._senders[key]

    def _serve(self, send: Callable[[List[Any]], int], key: int, head: bytes,
               halfway: Optional[Callable[[], None]]) -> int:
        first: List[Any] = [memoryview(head + self._prefix)]
        off, end, sent, half = 0, self._data_size, -len(head), self.size // 2
        while first or off < end:
            with self._cond:
                room = SEND_CHUNK_BYTES if halfway is None else max(0, half - len(self._prefix) - off)
                pieces, live = self._next_views(off, room) if off < end and room else ([], False)
                self._pins += live
            try:
                if pieces and isinstance(pieces[0], torch.Tensor):  # device bytes: copied to the host first
                    assert self._staging is not None
                    pieces = [self._staging.to_host(pieces[0])]
                    self._unpin()
                    live = False
                n = _send_all(send, first + pieces)
            finally:
                if live:
                    self._unpin()
            off += n - sum(len(v) for v in first)
            sent, first = sent + n, []
            with self._cond:
                self._senders[key][0] = off
            if halfway is not None and sent >= half:
                halfway()
                halfway = None
        return sent

    def _unpin(self) -> None:
        with self._cond:
            self._pins -= 1
            self._cond.notify_all()

    def freeze(self, wait_s: float = FREEZE_GRACE_S) -> bool:
        """From now on read no live tensor: the donor's state may change.

        Waits for reads of the live state in progress (a send from a host tensor, a copy from a device
        tensor), cuts off sends still blocked after ``wait_s`` seconds, then copies what responses in flight
        have not sent yet into host memory they go on from.

        Returns:
            ``False`` if a write from the live state still ran ``wait_s`` seconds after the cut-off (log it).
        """
        with self._cond:
            if self._frozen:
                return True
            self._frozen = True
            if not self._cond.wait_for(lambda: self._pins == 0, wait_s):
                for _, cut in list(self._senders.values()):
                    cut()
                if not self._cond.wait_for(lambda: self._pins == 0, wait_s):
                    return False
            if self._senders:
                start = min(off for off, _ in self._senders.values())
                self._kept = self._copy_from(start)
                self._kept_from, self.staged_bytes = start, self._data_size - start
            self._segments = None
            return True

    def _copy_from(self, start: int) -> memoryview:
        """A host copy of the data from byte ``start`` to the end."""
        buf = torch.empty(self._data_size - start, dtype=torch.uint8)
        assert self._segments is not None
        out, pos = buf.numpy(), 0
        for seg, s0 in zip(self._segments, self._starts):
            a = max(start - s0, 0)
            if a < _length(seg):
                part = seg[a:]
                if isinstance(part, torch.Tensor):
                    buf[pos : pos + part.numel()].copy_(part)
                else:
                    out[pos : pos + len(part)] = part
                pos += _length(part)
        return out.data if len(out) else memoryview(b"")


def _length(seg: Segment) -> int:
    return seg.numel() if isinstance(seg, torch.Tensor) else len(seg)


_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux: the kernel maps every page in one call


def _populated(nbytes: int) -> mmap.mmap:
    """Anonymous private memory of ``nbytes`` bytes (at least 1), pages mapped up front where Linux allows."""
    return mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE)


class ReceiveBuffer:
    """Memory for a heal body's tensor bytes (``nbytes`` >= 0, else ValueError), mapped ahead in a thread.

    Mapped early so that page faults are not paid inside the transfer (``docs/heal.md``, "Receive memory").
    """

    def __init__(self, nbytes: int) -> None:
        if nbytes < 0:
            raise ValueError(f"nbytes={nbytes}: a receive buffer needs a capacity >= 0 bytes")
        self.nbytes = nbytes
        self._mm: Optional[mmap.mmap] = None
        self._ready = threading.Event()
        threading.Thread(target=self._map, name="ftbridge-heal-prefault", daemon=True).start()

    def _map(self) -> None:
        try:
            self._mm = _populated(self.nbytes)
            if not _POPULATE:  # touch one byte per page instead (torch releases the GIL)
                torch.frombuffer(self._mm, dtype=torch.uint8)[::PAGE_BYTES].fill_(0)
        finally:
            self._ready.set()

    def wait(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for the memory to be mapped; whether it is."""
        return self._ready.wait(max(0.0, seconds))

    def take(self, nbytes: int, deadline: float) -> Optional[memoryview]:
        """A writable view of the first ``nbytes`` bytes; ``None`` if too small, failed or unmapped at ``deadline``."""
        if nbytes > self.nbytes or not self._ready.wait(max(0.0, deadline - time.monotonic())) or self._mm is None:
            return None
        return memoryview(self._mm)[:nbytes]


def fresh_buffer(nbytes: int) -> memoryview:
    """A writable buffer of ``nbytes`` bytes, not filled, its pages mapped up front (:func:`_populated`)."""
    return memoryview(_populated(nbytes))[:nbytes]


def read_tensors(read_into: Callable[[memoryview], int], size: int, device: torch.device,
                 staging: Staging) -> Dict[str, torch.Tensor]:
    """Read the safetensors part of a heal body (``size`` bytes) into new tensors on ``device``, through
    ``staging`` (the GPU joiner's receive: no host copy of the body).

    The header is checked as :mod:`ftbridge.heal.wire` checks it before any allocation: at most ``size`` bytes.

    Raises:
        ValueError: a malformed or truncated header, or a dtype outside the wire format.
        ConnectionError: the body ended inside a tensor.
    """
    prefix = bytearray(8)
    if size < 8 or read_full(read_into, memoryview(prefix)) != 8:
        raise ValueError(f"heal state tensor blob of {size} bytes is truncated")
    (n,) = struct.unpack("<Q", prefix)
    if n > min(ST_MAX_HEADER_BYTES, size - 8):
        raise ValueError(f"safetensors header of {n} bytes does not fit a blob of {size} bytes")
    raw = bytearray(n)
    if read_full(read_into, memoryview(raw)) != n:
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
