"""Stream ordering of the cross-replica sync against DeepSpeed's CUDA streams, on CPU with fake streams.

The unit tests drive :class:`ftbridge.zero.stream_order.StreamOrder` directly; the engine tests put an
active one (fake CUDA backend) into a real one-rank DeepSpeed engine's gradient sync and check, from
the log of fake stream operations, the three rules of the module: every all-reduce is issued on the
sync stream after it waited for an event recorded on the stream that reduced the bucket; the work is
waited for on that same stream; DeepSpeed's stream then waits for a *done* event recorded after it.
"""

from __future__ import annotations

import contextlib
import itertools

import pytest

from ftbridge.zero.stream_order import StreamOrder
from tests.fakes import FakeManager, gpt_batch, tiny_engine


class FakeEvent:
    ids = itertools.count()

    def __init__(self, cuda, enable_timing=False):
        self.cuda, self.name, self.stream = cuda, f"e{next(self.ids)}", None

    def record(self, stream):
        self.stream = stream
        self.cuda.log.append(("record", stream.name, self.name))


class FakeStream:
    def __init__(self, cuda, name):
        self.cuda, self.name = cuda, name

    def wait_event(self, event):
        self.cuda.log.append(("wait", self.name, event.name))


class FakeCuda:
    """``torch.cuda`` as StreamOrder uses it: streams, events, the current stream; every operation logged."""

    def __init__(self):
        self.log = []
        self.default = FakeStream(self, "default")
        self.ds = FakeStream(self, "ds")  # DeepSpeed's reduction stream
        self._current = [self.default]

    def current_stream(self):
        return self._current[-1]

    def Event(self, enable_timing=False):  # torch.cuda's name
        return FakeEvent(self, enable_timing)

    @contextlib.contextmanager
    def stream(self, s):
        self._current.append(s)
        try:
            yield
        finally:
            self._current.pop()


def test_inactive_order_is_a_no_op():
    order = StreamOrder(False)
    order.begin()
    assert order.fence("any stream") == [] and order.fence_all(["a"]) == []
    with order.issuing([]), order.waiting():
        pass
    assert order.release(["a"]) is None and order.sync_stream is None


def test_fence_issue_release_order():
    cuda = FakeCuda()
    order = StreamOrder(True, backend=cuda)
    order.begin()
    with cuda.stream(cuda.ds):  # ZeRO-3's bucket point runs inside DeepSpeed's stream block
        fences = order.fence(cuda.ds)
        with order.issuing(fences):
            assert cuda.current_stream() is cuda.default  # issued on the sync stream, not DeepSpeed's
            cuda.log.append(("allreduce", cuda.current_stream().name, ""))
    done = order.release([cuda.ds, cuda.default])
    ev = fences[0].name
    assert cuda.log == [("record", "ds", ev), ("wait", "default", ev), ("allreduce", "default", ""),
                        ("record", "default", done.name), ("wait", "ds", done.name)]


class StreamCheckingManager(FakeManager):
    """Logs each all-reduce and each wait with the fake current stream."""

    cuda: FakeCuda = None

    def allreduce(self, tensor, reduce_op=None, **kwargs):
        cuda = self.cuda
        cuda.log.append(("allreduce", cuda.current_stream().name, ""))

        class Work:
            def wait(self, timeout=None):
                cuda.log.append(("work_wait", cuda.current_stream().name, ""))
                return True

        super().allreduce(tensor)
        return Work()


def check_log(log):
    """The three rules on one step's log; returns how many all-reduces it saw."""
    allreduces = [i for i, e in enumerate(log) if e[0] == "allreduce"]
    assert allreduces, "no all-reduce issued"
    for i in allreduces:
        assert log[i][1] == "default", f"all-reduce issued on stream {log[i][1]}, not the sync stream"
        ds_events = [e[2] for e in log[:i] if e[:2] == ("record", "ds")]
        assert ds_events, "all-reduce issued before any event on DeepSpeed's stream"
        last = ds_events[-1]
        at = max(j for j, e in enumerate(log[:i]) if e == ("record", "ds", last))
        assert ("wait", "default", last) in log[at:i], \
            f"all-reduce at {i} does not wait for the bucket's event {last}: {log[:i + 1]}"
    waits = [i for i, e in enumerate(log) if e[0] == "work_wait"]
    assert waits and all(log[i][1] == "default" for i in waits), "work waited on another stream than issued"
    done = [e[2] for e in log[max(waits):] if e[:2] == ("record", "default")]
    assert done and ("wait", "ds", done[0]) in log[max(waits):], \
        "DeepSpeed's stream never waits for the finished cross-replica all-reduce"
    return len(allreduces)


@pytest.mark.usefixtures("single_rank_world")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage, overlap", [(3, True), (2, True)])
def test_engine_per_bucket_sync_follows_deepspeed_stream(stage, overlap):
    cuda = FakeCuda()
    manager = type("M", (StreamCheckingManager,), {"cuda": cuda})
    eng = tiny_engine(stage, manager=manager, ds={"zero_optimization": {"overlap_comm": overlap}},
                      ft={"sync_mode": "per_bucket", "cross_replica_bucket_bytes": 0})
    eng.sync.order = StreamOrder(True, backend=cuda)
    eng.adapter.bucket_stream = lambda: cuda.ds
    eng.adapter.side_streams = lambda: [cuda.ds]
    _, loss = eng(*gpt_batch(0))
    eng.backward(loss)
    eng.step()
    assert eng.sync.issued_in_backward > 0, "the per-bucket point never fired"
    assert check_log(cuda.log) == len(eng.sync.plan) > 1
