"""The heal decoder's contract under crafted and fuzzed input (issue 17): ValueError or a valid result, never more.

A valid result is a nested dict with non-empty ``str`` keys without ``/``,
whose leaves are tensors or JSON scalars, whose tensors share no byte and hold
no more bytes than the body. Crafted cases pin what broke before (TypeError,
KeyError, RecursionError, overlapping views); ``hypothesis`` then throws
random bytes and mutated real bodies at both decode paths (``bytes``:
safetensors' own loader; ``bytearray``: the zero-copy views).
"""

from __future__ import annotations

import json
import struct
import time
import tracemalloc

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import SafetensorError
from safetensors.torch import load as st_load

from ftbridge.heal.wire import decode_parts, decode_state, encode_state

pytestmark = pytest.mark.timeout(120)
FUZZ = settings(max_examples=150, deadline=1000, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
SCALARS = (bool, int, float, str, type(None))


def framed(head, blob=b""):
    head = head if isinstance(head, bytes) else json.dumps(head).encode()
    return struct.pack("<Q", len(head)) + head + blob


def st_blob(entries, data):
    """A safetensors blob with the given header entries (any JSON) over ``data``."""
    head = json.dumps(entries).encode()
    return struct.pack("<Q", len(head)) + head + data


def assert_valid(state, body_len):
    """The contract's 'valid result'."""
    ranges = []

    def walk(node):
        assert type(node) is dict
        for key, value in node.items():
            assert isinstance(key, str) and key and "/" not in key, key
            if isinstance(value, dict):
                walk(value)
            elif isinstance(value, torch.Tensor):
                if value.numel():
                    start = value.untyped_storage().data_ptr() + value.storage_offset() * value.element_size()
                    ranges.append((start, start + value.numel() * value.element_size()))
            else:
                assert isinstance(value, SCALARS), type(value)

    walk(state)
    assert sum(e - s for s, e in ranges) <= body_len
    ranges.sort()
    assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:])), "two tensors share bytes"


def decode_both(body):
    """Decode ``body`` along both paths; each must end in ValueError or a valid result."""
    for path in ("bytes", "bytearray"):
        try:
            if path == "bytes":
                state = decode_state(body)
            else:
                (n,) = struct.unpack("<Q", body[:8]) if len(body) >= 8 else (0,)
                if len(body) < 8 or 8 + n > len(body):
                    continue  # framing is checked before the split; decode_state covers it
                state = decode_parts(body[8:8 + n], bytearray(body[8 + n:]))
        except ValueError:
            continue
        assert_valid(state, len(body))


# -- crafted headers that raised something else than ValueError before -------------------------

_T = st_blob({"t0": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8)
CRAFTED = {
    "deeply nested header (RecursionError)": framed(b"[" * 200_000),
    "deeply nested value (RecursionError)": framed(b'{"a": {"v": ' + b"[" * 200_000 + b"]" * 200_000 + b"}}"),
    "empty entry kind (KeyError)": framed({"a": {"": 1}}),
    "two-letter entry kind (KeyError)": framed({"a": {"tv": 1}}),
    "unhashable tensor name (TypeError)": framed({"a": {"t": ["t0"]}}, _T),
    "path through a scalar (TypeError)": framed({"a": {"v": 1}, "a/b": {"v": 2}}),
    "path through a tensor (TypeError)": framed({"a": {"t": "t0"}, "a/b": {"v": 2}}, _T),
    "leaf given twice": framed({"a/b": {"v": 1}, "a": {"v": 2}}),
    "empty path component": framed({"a//b": {"v": 1}}),
    "list as a scalar": framed({"a": {"v": [1, 2]}}),
    "dict as a scalar": framed({"a": {"v": {"x": 1}}}),
    "d that is not true": framed({"a": {"d": 0}}),
    "one tensor named twice (aliases)": framed({"a": {"t": "t0"}, "b": {"t": "t0"}}, _T),
    "tensor the header does not name": framed({}, _T),
    "integer of 5000 digits": framed(b'{"a": {"v": ' + b"9" * 5000 + b"}}"),
    "header is not UTF-8": framed(b'{"a": {"v": "\xff"}}'),
    "path of 65 levels": framed({"/".join("k" * 65): {"v": 1}}),
}


@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_crafted_header_raises_value_error(name):
    for decode in (decode_state, lambda b: decode_parts(b[8:8 + struct.unpack("<Q", b[:8])[0]],
                                                        bytearray(b[8 + struct.unpack("<Q", b[:8])[0]:]))):
        with pytest.raises(ValueError):
            decode(CRAFTED[name])


# -- safetensors' offset rules on the zero-copy path ---------------------------------------------

def _two(a, b, data_len=24, dtype="F32"):
    return st_blob({"t0": {"dtype": dtype, "shape": [(a[1] - a[0]) // 4], "data_offsets": list(a)},
                    "t1": {"dtype": dtype, "shape": [(b[1] - b[0]) // 4], "data_offsets": list(b)}},
                   bytes(range(data_len)))


BAD_BLOBS = {
    "overlapping tensors": _two((0, 16), (8, 24)),
    "one tensor inside another": _two((0, 24), (8, 16)),
    "same bytes twice": _two((0, 12), (0, 12), data_len=12),
    "a gap between tensors": _two((0, 8), (16, 24)),
    "trailing data": _two((0, 8), (8, 16)),
    "offsets past the end": _two((0, 8), (8, 32)),
    "end before begin": st_blob({"t0": {"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}}, b"\0" * 8),
    "negative shape": st_blob({"t0": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8),
    "bool in shape": st_blob({"t0": {"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}}, b"\0"),
    "float offsets": st_blob({"t0": {"dtype": "F32", "shape": [2], "data_offsets": [0.0, 8.0]}}, b"\0" * 8),
    "metadata not strings": st_blob({"__metadata__": {"a": 1}}, b""),
}


@pytest.mark.parametrize("name", sorted(BAD_BLOBS))
def test_tensor_layouts_safetensors_refuses_are_refused_on_the_view_path_too(name):
    blob = BAD_BLOBS[name]
    with pytest.raises(SafetensorError):  # safetensors' own verdict: the rule is theirs
        st_load(blob)
    head = json.dumps({"a": {"t": "t0"}, "b": {"t": "t1"}} if b'"t1"' in blob else {"a": {"t": "t0"}}).encode()
    with pytest.raises(ValueError):
        decode_parts(head, bytearray(blob))


def test_views_of_a_valid_body_never_alias():
    body = encode_state({"a": torch.arange(4.0), "b": torch.arange(4.0, 8.0)})
    (n,) = struct.unpack("<Q", body[:8])
    got = decode_parts(body[8:8 + n], bytearray(body[8 + n:]))
    got["a"].fill_(-1)
    assert torch.equal(got["b"], torch.arange(4.0, 8.0))


# -- fuzzing -------------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)

tensors = st.builds(
    lambda dtype, shape: torch.zeros(shape, dtype=dtype),
    st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool, torch.float64]),
    st.lists(st.integers(0, 4), max_size=3))
keys = st.text(st.characters(blacklist_characters="/", blacklist_categories=("Cs",)), min_size=1, max_size=6)
states = st.recursive(
    st.dictionaries(keys, st.none() | st.integers() | st.text(max_size=4) | tensors, max_size=4),
    lambda inner: st.dictionaries(keys, inner, max_size=3), max_leaves=10)


@FUZZ
@given(st.binary(max_size=2048))
def test_random_bytes_decode_to_value_error_or_a_valid_state(body):
    decode_both(body)


@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes_after_a_valid_prefix_decode_to_value_error_or_a_valid_state(tail):
    decode_both(framed({"a": {"t": "t0"}}, struct.pack("<Q", len(tail)) + tail))
    decode_both(framed(tail))


def _mutated(state, where, value, cut, flip):
    body = bytearray(encode_state(state))
    (n,) = struct.unpack("<Q", body[:8])
    head = json.loads(body[8:8 + n])
    blob = bytes(body[8 + n:])
    if where == "outer" and head:
        key = sorted(head)[len(head) // 2]
        head[key] = value
    elif where == "outer_key" and head:
        head[str(value)[:12] or "k"] = head.pop(sorted(head)[0])
    elif where == "st" and blob:
        (m,) = struct.unpack("<Q", blob[:8])
        st_head = json.loads(blob[8:8 + m])
        name = sorted(st_head)[0]
        field = ("dtype", "shape", "data_offsets")[len(str(value)) % 3]
        st_head[name] = dict(st_head[name], **{field: value})
        blob = st_blob(st_head, blob[8 + m:])
    out = bytearray(framed(json.dumps(head).encode(), blob))
    if flip is not None and out:
        out[flip % len(out)] ^= 0x5A
    return bytes(out[:cut]) if cut is not None else bytes(out)


@FUZZ
@given(states, st.sampled_from(["outer", "outer_key", "st", "none"]), json_values,
       st.none() | st.integers(0, 4096), st.none() | st.integers(0, 1 << 16))
def test_mutated_real_bodies_decode_to_value_error_or_a_valid_state(state, where, value, cut, flip):
    body = _mutated(state, where, value, cut, flip)
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        decode_both(body)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - t0 < 1.0
    assert peak < (1 << 20) + 200 * len(body), f"{peak} bytes for a body of {len(body)}"


paths = st.lists(st.sampled_from(["a", "b", ""]), min_size=1, max_size=3).map("/".join)
entries = st.builds(lambda kind, value: {kind: value}, st.sampled_from(["t", "v", "d", "tv", ""]),
                    json_values | st.sampled_from(["t0", "t1", True]))
offsets = st.tuples(st.integers(0, 24), st.integers(0, 24))


@FUZZ
@given(st.dictionaries(paths, entries, max_size=5), offsets, offsets, st.sampled_from(["F32", "U8", "I16"]))
def test_headers_from_pieces_decode_to_value_error_or_a_valid_state(header, off0, off1, dtype):
    size = {"F32": 4, "U8": 1, "I16": 2}[dtype]
    blob = st_blob({f"t{i}": {"dtype": dtype, "shape": [max(0, (e - b) // size)], "data_offsets": [b, e]}
                    for i, (b, e) in enumerate((off0, off1))}, bytes(range(24)))
    decode_both(framed(header, blob))


@FUZZ
@given(states)
def test_every_encodable_state_roundtrips(state):
    body = encode_state(state)
    for got in (decode_state(body), decode_parts(body[8:8 + struct.unpack("<Q", body[:8])[0]],
                                                 bytearray(body[8 + struct.unpack("<Q", body[:8])[0]:]))):
        assert_valid(got, len(body))
        assert json.dumps(_shape(got), sort_keys=True) == json.dumps(_shape(state), sort_keys=True)


def _shape(node):
    if isinstance(node, dict):
        return {k: _shape(v) for k, v in node.items()}
    if isinstance(node, torch.Tensor):
        return [str(node.dtype), list(node.shape)]
    return node
