"""Checks that need a CUDA GPU (marker ``cuda``): skipped with the reason on CPU machines.

They run in ``scripts/device_check.sh``'s environment (``python -m pytest -m cuda tests/test_cuda.py``);
both passed on an NVIDIA H200 on 2026-12-04 (docs/gpu.md).
"""

from __future__ import annotations

import pytest
import torch

from ftbridge.staging import Staging
from ftbridge.zero.stream_order import StreamOrder

pytestmark = pytest.mark.cuda


def test_staged_heal_body_from_and_to_the_gpu():
    import io

    from ftbridge.heal.stream import StreamBody, read_tensors
    from ftbridge.heal.wire import decode_parts, plan_body

    state = {"a": torch.randn(1000, device="cuda"), "b": {"c": torch.arange(77, device="cuda")}, "s": 3}
    buf = Staging(4096)
    assert buf.pin
    body = StreamBody(plan_body(state), staging=buf)
    chunks = []

    def send(views):  # a view of the pinned buffer lives until the next copy: keep its bytes now
        chunks.extend(bytes(v) for v in views)
        return sum(len(v) for v in views)

    body.serve(send, cut=lambda: None)
    data = b"".join(chunks)
    assert buf.chunks_moved >= 2 and len(data) == body.size
    n = int.from_bytes(data[:8], "little")
    blob = data[8 + n:]
    tensors = read_tensors(io.BytesIO(blob).readinto, len(blob), torch.device("cuda"), Staging(1024))
    got = decode_parts(data[8:8 + n], tensors)
    assert got["a"].is_cuda
    torch.testing.assert_close(got["a"], state["a"], rtol=0, atol=0)
    torch.testing.assert_close(got["b"]["c"], state["b"]["c"], rtol=0, atol=0)
    # A response in flight when the donor's step may begin goes on from a host copy of the GPU bytes.
    import threading

    from ftbridge.heal.wire import encode_state

    want = encode_state(state)
    frozen = StreamBody(plan_body(state), staging=buf)
    paused, go, out = threading.Event(), threading.Event(), bytearray()

    def halfway():
        paused.set()
        assert go.wait(10)

    def keep(views):
        out.extend(b"".join(bytes(v) for v in views))
        return sum(len(v) for v in views)

    sender = threading.Thread(target=lambda: frozen.serve(keep, cut=lambda: None, halfway=halfway))
    sender.start()
    assert paused.wait(10) and frozen.freeze(wait_s=5)
    state["a"].fill_(-1.0)  # the donor's optimizer step
    go.set()
    sender.join(10)
    assert bytes(out) == want and frozen.staged_bytes > 0


def test_stream_order_makes_the_sync_stream_wait_for_the_bucket():
    side = torch.cuda.Stream()
    x = torch.zeros(1 << 22, device="cuda")
    order = StreamOrder(True)
    order.begin()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # keep the side stream busy, then write the bucket
        x.fill_(1.0)
        fences = order.fence(side)
    with order.issuing(fences):
        y = x.sum()  # would read zeros without the event wait
    assert float(y) == x.numel()
    order.release([side])
