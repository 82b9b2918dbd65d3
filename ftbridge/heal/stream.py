"""The donor's heal body, sent straight from its live state while that state may not change.

Before, the donor encoded its whole state into one ``bytes`` (three copies
through ``safetensors``, into freshly allocated memory) and only then
served it: at 10 MB the encode took 30 ms of a 44 ms heal, on the joiner's
critical path. Now :meth:`ftbridge.manager.transport.SafeHTTPTransport.send_checkpoint`
only lays the body out from keys, shapes and dtypes
(:func:`ftbridge.heal.wire.plan_body`, well under a millisecond) and a
:class:`StreamBody` sends each tensor's bytes from the tensor itself, in
chunks of :data:`SEND_CHUNK_BYTES`. The bytes on the wire are those of
:func:`ftbridge.heal.wire.encode_state`, so the joiner's hostile-input decode is
unchanged.

Why that is a consistent snapshot: torchft calls ``send_checkpoint`` at the
start of a step and ``disallow_checkpoint`` right before the donor's
optimizer step, the first point where the state may change (the old encode
read the same live tensors in the same window). :meth:`StreamBody.freeze`,
run by ``disallow_checkpoint``, waits for the chunks being written, copies
the bytes that responses still in flight have not sent yet into a staging
buffer, and from then on they send from that copy: the donor's step never
waits for a slow joiner, and a joiner never gets a torn state. A state
function must therefore return tensors nobody writes before the step
(ftbridge's own do: ZeRO's optimizer state changes only in the step, the
PowerSGD hook state is a clone).

Where a device-staging step slots in:
:func:`ftbridge.heal.wire.tensor_bytes` turns each tensor into the CPU bytes that
are sent (a view for a contiguous CPU tensor, a copy otherwise); a GPU path
replaces that copy with one into a pinned buffer, and nothing else changes.
"""

from __future__ import annotations

import bisect
import mmap
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Union

import torch

from ftbridge.heal.wire import BodyPlan, tensor_bytes

SEND_CHUNK_BYTES = 32 << 20
"""Most bytes written from the live state in one write (bytes): bounds how long :meth:`StreamBody.freeze` waits."""
FREEZE_GRACE_S = 1.0
"""How long :meth:`StreamBody.freeze` waits for a write from the live state before cutting that response off (s)."""
PAGE_BYTES = 4096


MAX_IOVECS = 512
"""Most buffers passed to one ``sendmsg`` (Linux allows 1024)."""


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
    """The body can no longer be sent (the donor's state changed before this response got its bytes)."""


def _byte_view(t: torch.Tensor) -> memoryview:
    flat = tensor_bytes(t)
    return flat.numpy().data if flat.numel() else memoryview(b"")


class StreamBody:
    """One heal body: a prefix, then each tensor's bytes, sent from the tensors until :meth:`freeze`.

    Args:
        plan: the body's layout (:func:`ftbridge.heal.wire.plan_body`), whose
            tensors are read while responses are served; or a whole
            encoded body (``bytes``).

    Attributes:
        size: bytes of the whole body (the ``Content-Length``).
    """

    def __init__(self, plan: Union[BodyPlan, bytes]) -> None:
        self._cond = threading.Condition()
        if isinstance(plan, BodyPlan):
            self._prefix, self.size = plan.prefix, plan.size
            self._segments: Optional[List[memoryview]] = [_byte_view(t) for t in plan.tensors]
        else:
            self._prefix, self.size, self._segments = bytes(plan), len(plan), []
        self._starts = [0]
        for seg in self._segments:
            self._starts.append(self._starts[-1] + len(seg))
        self._data_size = self.size - len(self._prefix)
        self._frozen = False
        self._pins = 0  # writes from the live state in progress
        self._senders: Dict[int, List[Any]] = {}  # id -> [bytes of the data sent, cut-off callback]
        self._staged: Optional[memoryview] = None
        self._staged_from = self._data_size
        self.staged_bytes = 0
        """Bytes copied by :meth:`freeze` for responses still in flight (0: every response finished first)."""

    def _next_views(self, off: int, room: int) -> tuple:
        """``(views of the data from off, live)``, at most ``room`` bytes in all; caller holds the lock."""
        if off >= self._staged_from and self._staged is not None:
            a = off - self._staged_from
            return [self._staged[a : a + room]], False
        if self._frozen or self._segments is None:
            raise BodyAborted("the donor's state may change now, and the rest of this response was not kept")
        i = bisect.bisect_right(self._starts, off) - 1
        views: List[memoryview] = []
        while i < len(self._segments) and room > 0 and len(views) < MAX_IOVECS:
            a = max(off - self._starts[i], 0)
            view = self._segments[i][a : a + room]
            if len(view):
                views.append(view)
                room -= len(view)
            i += 1
        return views, True

    def serve(self, send: Callable[[List[Any]], int], cut: Callable[[], None], head: bytes = b"",
              halfway: Optional[Callable[[], None]] = None) -> int:
        """Send ``head`` and the whole body with ``send``; returns the body bytes sent (``size``).

        Args:
            send: sends some of a list of bytes-like objects, returns how many
                bytes (``socket.sendmsg``; a blocking socket sends them all in
                one system call).
            cut: makes a blocked ``send`` fail at once (shuts the socket
                down); :meth:`freeze` calls it if this response holds it up.
            head: bytes sent first, with the body's prefix (the HTTP
                response headers): one system call for a small body.
            halfway: called once half of the body is sent (the first sends
                stop there; ``faults.point("heal_send")``).

        Raises:
            BodyAborted: the state was frozen before this response could keep
                its remaining bytes. ``OSError`` from ``send``.
        """
        first, key = [memoryview(head + self._prefix)], id(cut)
        off, end, sent, half = 0, self._data_size, -len(head), self.size // 2
        with self._cond:
            self._senders[key] = [0, cut]
        try:
            while first or off < end:
                with self._cond:
                    room = SEND_CHUNK_BYTES if halfway is None else max(0, half - len(self._prefix) - off)
                    views, live = self._next_views(off, room) if off < end and room else ([], False)
                    self._pins += live
                try:
                    n = _send_all(send, first + views)
                finally:
                    if live:
                        with self._cond:
                            self._pins -= 1
                            self._cond.notify_all()
                off += n - sum(len(v) for v in first)
                sent, first = sent + n, []
                with self._cond:
                    self._senders[key][0] = off
                if halfway is not None and sent >= half:
                    halfway()
                    halfway = None
        finally:
            with self._cond:
                del self._senders[key]
        return sent

    def freeze(self, wait_s: float = FREEZE_GRACE_S) -> bool:
        """From now on, read no live tensor: the donor's state may change.

        Waits for the writes from the live state in progress (responses
        whose writes are still blocked after ``wait_s`` seconds are cut off),
        then copies the data that responses in flight have not sent yet
        into a staging buffer they go on from.

        Returns:
            ``False`` if a write from the live state was still running after
            it was cut off and ``wait_s`` more seconds (the caller should log it).
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
                self._staged = self._copy_from(start)
                self._staged_from, self.staged_bytes = start, self._data_size - start
            self._segments = None
            return True

    def _copy_from(self, start: int) -> memoryview:
        """A copy of the data from byte ``start`` to the end (one allocation, no fill)."""
        buf = torch.empty(self._data_size - start, dtype=torch.uint8)
        assert self._segments is not None
        out, pos = buf.numpy(), 0
        for seg, s0 in zip(self._segments, self._starts):
            a = max(start - s0, 0)
            if a < len(seg):
                part = memoryview(seg)[a:]
                out[pos : pos + len(part)] = part
                pos += len(part)
        return out.data if len(out) else memoryview(b"")


_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux: the kernel maps every page in one call


def _populated(nbytes: int) -> mmap.mmap:
    """Anonymous private memory of ``nbytes`` bytes (at least 1), its pages mapped up front where Linux allows.

    ``MAP_POPULATE`` maps them in one system call (the GIL is released),
    about twice as fast here as faulting them in one by one.
    """
    return mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE)


class ReceiveBuffer:
    """Memory for a heal body's tensor bytes, mapped ahead of the heal in a background thread.

    Writing to fresh pages costs their page faults: here about 1.7 ms per
    MB (600 MB/s, a quarter of a loopback socket), paid inside the transfer
    when the joiner receives into new memory. A restarted rank maps this
    while it starts up (:meth:`ftbridge.manager.transport.SafeHTTPTransport.prepare_recv`)
    and the fetch receives into it.

    Args:
        nbytes: capacity (bytes, >= 0).

    Raises:
        ValueError: ``nbytes`` < 0.
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
        """A writable view of the first ``nbytes`` bytes once mapped.

        ``None`` if too small, not ready by ``deadline`` (``time.monotonic()``) or the mapping failed.
        """
        if nbytes > self.nbytes or not self._ready.wait(max(0.0, deadline - time.monotonic())) or self._mm is None:
            return None
        return memoryview(self._mm)[:nbytes]


def fresh_buffer(nbytes: int) -> memoryview:
    """A writable buffer of ``nbytes`` bytes, not filled, its pages mapped up front (:func:`_populated`)."""
    return memoryview(_populated(nbytes))[:nbytes]
