"""GPU staging (ftbridge.staging) and the GPU joiner's receive (ftbridge.heal.stream.read_tensors), on CPU.

The donor's staged body is tested with the host one in tests/test_heal_stream.py (fixture ``staging``)."""

from __future__ import annotations

import io

import pytest
import torch

from ftbridge import staging
from ftbridge.heal.stream import read_tensors
from ftbridge.heal.wire import decode_parts, encode_state
from ftbridge.staging import Staging, staging_size


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


def test_to_host_copies_at_most_one_buffer_and_refuses_more():
    buf = _cpu_staging(8)
    data = torch.arange(8, dtype=torch.uint8)
    assert bytes(buf.to_host(data)) == bytes(range(8)) and buf.chunks_moved == 1
    with pytest.raises(ValueError, match="9 bytes do not fit the 8-byte staging buffer"):
        buf.to_host(torch.zeros(9, dtype=torch.uint8))
    assert buf.moves(data) and not Staging(8, pin=False).moves(data)


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
