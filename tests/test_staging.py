"""GPU staging of heal bodies and snapshots (ftbridge.staging), on CPU: sizes, chunking, byte layout, the transport."""

from __future__ import annotations

import io
from datetime import timedelta

import pytest
import torch

from ftbridge import staging
from ftbridge.heal.wire import decode_parts, decode_state, encode_state
from ftbridge.manager import transport
from ftbridge.staging import Staging, read_tensors, staged_body, staging_size


def _bound() -> int:
    """The largest heal body a transport in these tests accepts: 64 MiB."""
    return 64 << 20


def _state():
    flat = torch.arange(40, dtype=torch.float32)
    return {"optimizer": {"flat": flat, "view_a": flat[:10], "view_b": flat[10:25].view(3, 5),
                          "moments": torch.randn(7, 3, dtype=torch.bfloat16), "step": 4, "empty": {}},
            "counters": {"global_steps": 12, "name": "x", "none": None},
            "mask": torch.tensor([True, False, True]), "ids": torch.arange(5, dtype=torch.int64)}


def _cpu_staging(nbytes):
    s = Staging(nbytes, pin=False)
    s.stage_cpu = True  # CPU tensors take the device path: copied through the buffer, chunk by chunk
    return s


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            _assert_same(a[k], b[k])
        elif isinstance(a[k], torch.Tensor):
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
        else:
            assert a[k] == b[k]


def test_staging_size():
    assert staging_size([]) == 0
    assert staging_size([100]) == 4096
    assert staging_size([10 << 20, 100 << 20], cap_bytes=32 << 20) == 32 << 20
    assert staging_size([5 << 20, 3000], cap_bytes=32 << 20) == 5 << 20
    with pytest.raises(ValueError, match="cap_bytes=0"):
        staging_size([1], cap_bytes=0)


def test_staged_body_is_the_wire_format_through_one_small_buffer():
    state = _state()
    buf = _cpu_staging(24)  # smaller than most tensors: many chunks
    body = staged_body(state, buf, force=True)
    out = []
    body.write_to(lambda v: out.append(bytes(v)))  # a view lives until the next chunk
    data = b"".join(bytes(v) for v in out)
    assert len(data) == len(body)
    _assert_same(decode_state(data), state)
    expected = sum(-(-t.numel() * t.element_size() // 24) for t in body.tensors)
    assert buf.chunks_moved == expected > len(body.tensors)
    assert buf.buffer().numel() == 24, "the staging buffer grew"
    # Same bytes as the unstaged encoder's tensors: safetensors itself loads the blob.
    n = int.from_bytes(data[:8], "little")
    _assert_same(decode_parts(data[8:8 + n], bytes(data[8 + n:])), state)
    assert data == encode_state(state), "the staged body is byte for byte the encoder's"
    assert staged_body(state, buf) is None, "a CPU-only state is encoded whole, as before"
    odd = {"w": torch.zeros(4, dtype=torch.float8_e4m3fn)}  # safetensors writes those: the whole body, encoded
    assert staged_body(odd, buf, force=True) is None
    assert decode_state(encode_state(odd))["w"].dtype == torch.float8_e4m3fn


def test_read_tensors_chunks_into_device_tensors_and_refuses_bad_bodies():
    state = _state()
    data = encode_state(state)
    n = int.from_bytes(data[:8], "little")
    blob = data[8 + n:]
    buf = _cpu_staging(16)
    tensors = read_tensors(io.BytesIO(blob).readinto, len(blob), torch.device("cpu"), buf)
    _assert_same(decode_parts(data[8:8 + n], tensors), state)
    assert buf.chunks_moved > len(tensors)
    with pytest.raises(ConnectionError, match="ended inside tensor"):
        read_tensors(io.BytesIO(blob[:-3]).readinto, len(blob), torch.device("cpu"), buf)
    bad = bytearray(blob)
    bad[8] = ord("[")
    with pytest.raises(ValueError):
        read_tensors(io.BytesIO(bytes(bad)).readinto, len(bad), torch.device("cpu"), buf)
    with pytest.raises(ValueError, match="does not fit"):
        read_tensors(io.BytesIO(blob).readinto, 12, torch.device("cpu"), buf)
    odd = encode_state({"w": torch.zeros(4, dtype=torch.float8_e4m3fn)})
    n = int.from_bytes(odd[:8], "little")
    with pytest.raises(ValueError, match="dtype F8_E4M3 is not one the heal can receive onto a device"):
        read_tensors(io.BytesIO(odd[8 + n:]).readinto, len(odd) - 8 - n, torch.device("cpu"), buf)


def test_host_copy_of_a_storage():
    t = torch.arange(6, dtype=torch.float32)
    copy = staging.host_copy(t.untyped_storage(), pin=False)
    out = torch.empty(0, dtype=torch.float32).set_(copy, 0, (6,), (1,))
    t.add_(1)
    torch.testing.assert_close(out, torch.arange(6, dtype=torch.float32))


@pytest.mark.timeout(60)
def test_transport_serves_a_staged_body_and_waits_for_it_before_state_changes(monkeypatch):
    monkeypatch.setattr(transport, "staged_body", lambda state, stg: staged_body(state, stg, force=True))
    donor = transport.SafeHTTPTransport("127.0.0.1", timedelta(seconds=10), max_recv_bytes=_bound)
    joiner = transport.SafeHTTPTransport("127.0.0.1", timedelta(seconds=10), max_recv_bytes=_bound)
    try:
        donor._staging.stage_cpu = True
        state = _state()
        donor.send_checkpoint([1], 3, state, timedelta(seconds=10))
        assert isinstance(donor._body, staging.StagedBody)
        got = joiner.recv_checkpoint(0, donor.metadata(), 3, timedelta(seconds=10))
        _assert_same(got, state)
        donor.disallow_checkpoint()  # returns once the handler finished writing
        assert donor._staging.chunks_moved > 0 and donor._sending == 0
        # A response still writing from the live tensors holds disallow_checkpoint (the optimizer step) back.
        import threading
        donor._sending = 1
        stopper = threading.Thread(target=donor.disallow_checkpoint)
        stopper.start()
        stopper.join(0.3)
        assert stopper.is_alive(), "disallow_checkpoint returned while a staged response was being written"
        donor._sent_staged()
        stopper.join(5)
        assert not stopper.is_alive()
    finally:
        donor.shutdown()
        joiner.shutdown()
