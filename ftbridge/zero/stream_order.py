"""Ordering of the cross-replica all-reduce against DeepSpeed's CUDA streams; a no-op on the CPU.

DeepSpeed reduces gradient buckets on side streams; the sync reads what they wrote and
may send a view of DeepSpeed's own buffer in place. :class:`StreamOrder` applies three rules:

1. **fence**: record an event on the stream that produced a reduced bucket
   (:meth:`StreamOrder.fence`), or on every side stream after backward (:meth:`StreamOrder.fence_all`);
2. **issue** the copy, a hook's casts and the all-reduce on one *sync stream* (the training
   thread's stream when backward starts, :meth:`StreamOrder.begin`) after a GPU-side wait for the
   fence (:meth:`StreamOrder.issuing`); torchft 0.2 requires its work to be waited on the stream
   it was created on, so the sync stream is also where it is waited;
3. **release**: after the step's all-reduces were waited for, DeepSpeed's side streams wait on a
   *done* event (:meth:`StreamOrder.release`), so DeepSpeed never writes a buffer still in use.

The CUDA calls go through ``backend`` (default ``torch.cuda``), so the decisions are tested on
CPU with fakes. See docs/gpu.md, "What the GPU code does".
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator, List, Optional, Sequence


class StreamOrder:
    """Fences, sync stream and release events of one rank's cross-replica gradient sync.

    Args:
        active: the gradient partition is on a GPU (``False``: every method is a no-op).
        backend: ``current_stream()``, ``Event(enable_timing=...)``, ``stream(s)``; default ``torch.cuda``.
        timing: also time each :meth:`waiting` block, for :meth:`exposed_wait_s`.
    """

    def __init__(self, active: bool, backend: Any = None, timing: bool = False) -> None:
        self.active = bool(active)
        if self.active and backend is None:
            import torch

            backend = torch.cuda
        self.backend = backend
        self.timing = timing
        self.sync_stream: Any = None
        """The stream the cross-replica work of this step is issued and waited on (``None`` on CPU)."""
        self._spans: List[Any] = []

    def begin(self) -> None:
        """At the start of a backward, on the training thread: take its current stream as the sync stream."""
        if self.active:
            self.sync_stream = self.backend.current_stream()

    def fence(self, producer: Any = None) -> List[Any]:
        """Record an event on ``producer`` (``None``: the current stream), the stream that reduced a
        bucket; return ``[event]`` for :meth:`issuing` (``[]`` on CPU).
        """
        if not self.active:
            return []
        stream = producer if producer is not None else self.backend.current_stream()
        event = self.backend.Event()
        event.record(stream)
        return [event]

    def fence_all(self, producers: Iterable[Any]) -> List[Any]:
        """:meth:`fence` on each of ``producers`` (DeepSpeed's side streams) and on the current stream."""
        if not self.active:
            return []
        out = self.fence(None)
        for stream in producers:
            out.extend(self.fence(stream))
        return out

    @contextlib.contextmanager
    def issuing(self, fences: Sequence[Any] = ()) -> Iterator[None]:
        """Run the block on the sync stream, after it waited (on the GPU) for every event of ``fences``."""
        if not self.active:
            yield
            return
        if self.sync_stream is None:
            self.begin()
        for event in fences:
            self.sync_stream.wait_event(event)
        with self.backend.stream(self.sync_stream):
            yield

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """:meth:`issuing` for the block that waits for the step's work; timed when ``timing``."""
        with self.issuing():
            if not (self.active and self.timing):
                yield
                return
            start, end = self.backend.Event(enable_timing=True), self.backend.Event(enable_timing=True)
            start.record(self.sync_stream)
            yield
            end.record(self.sync_stream)
            self._spans.append((start, end))

    def release(self, side_streams: Iterable[Any]) -> Optional[Any]:
        """After the step's all-reduces were waited for: make ``side_streams`` wait for them; return the
        *done* event on the sync stream (``None`` on CPU).
        """
        if not self.active or self.sync_stream is None:
            return None
        done = self.backend.Event()
        done.record(self.sync_stream)
        for stream in side_streams:
            if stream is not self.sync_stream:
                stream.wait_event(done)
        return done

    def exposed_wait_s(self) -> float:
        """Seconds the sync stream stalled in :meth:`waiting` blocks so far (``timing`` only; synchronises)."""
        total = 0.0
        for start, end in self._spans:
            end.synchronize()
            total += start.elapsed_time(end) / 1000.0
        return total


def side_streams(optimizer: Any,
                 names: Sequence[str] = ("reduction_stream", "reduce_and_partition_stream")) -> List[Any]:
    """DeepSpeed's side streams that exist on ``optimizer`` (CUDA streams only; ``[]`` on CPU)."""
    try:
        import torch

        kinds: tuple = (torch.cuda.Stream,) if torch.cuda.is_available() else ()
    except Exception:  # noqa: BLE001
        kinds = ()
    out = []
    for name in names:
        stream = getattr(optimizer, name, None)
        if stream is not None and kinds and isinstance(stream, kinds):
            out.append(stream)
    return out
