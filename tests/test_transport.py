"""Unit tests for ftbridge.manager.transport: the pickle-free wire format and the HTTP heal transport.

The HTTP tests run donor and receiver in one process (the server runs in its
own threads); every test that opens a socket has a short timeout.
"""

import http.server
import json
import math
import pickle
import socket
import struct
import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta

import pytest
import torch
from safetensors.torch import load as st_load
from torchft.checkpointing.transport import CheckpointTransport

from ftbridge.manager.transport import SafeHTTPTransport, decode_state, encode_state


def _bound() -> int:
    """The largest heal body a transport in these tests accepts: 64 MiB."""
    return 64 << 20

NET_TIMEOUT = pytest.mark.timeout(30)


def roundtrip(state):
    return decode_state(encode_state(state))


def assert_same_state(got, want):
    """Equal structure, equal scalars, bit-equal tensors with the same dtype and shape."""
    assert type(got) is dict and set(got) == set(want), (sorted(got), sorted(want))
    for key, w in want.items():
        g = got[key]
        if isinstance(w, dict):
            assert_same_state(g, w)
        elif isinstance(w, torch.Tensor):
            assert isinstance(g, torch.Tensor)
            assert g.dtype == w.dtype and g.shape == w.shape
            torch.testing.assert_close(g, w.detach().cpu(), rtol=0, atol=0, equal_nan=True)
        elif isinstance(w, float) and math.isnan(w):
            assert isinstance(g, float) and math.isnan(g)
        else:
            assert type(g) is type(w) and g == w, (key, g, w)


def sample_state():
    gen = torch.Generator().manual_seed(7)
    return {
        "model": {
            "w": torch.randn(4, 3, generator=gen),
            "b16": torch.randn(5, generator=gen).to(torch.bfloat16),
            "f16": torch.randn(2, 2, generator=gen).to(torch.float16),
            "f64": torch.randn(3, generator=gen, dtype=torch.float64),
        },
        "optim": {
            "state": {"0": {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 3, generator=gen)}},
            "counts": torch.arange(6, dtype=torch.int64).reshape(2, 3),
            "mask": torch.tensor([True, False, True]),
            "i8": torch.tensor([-3, 0, 7], dtype=torch.int8),
        },
        "zero_dim_int": torch.tensor(42),
        "empty": torch.empty(0),
        "empty_2d": torch.zeros(0, 5, dtype=torch.int32),
        "scalars": {
            "int": 7, "neg": -12, "big": 2 ** 62, "float": 0.125, "inf": float("inf"),
            "ninf": float("-inf"), "nan": float("nan"), "true": True, "false": False,
            "str": "héllo wörld", "none": None, "empty_str": "",
        },
        "empty_dict": {},
        "nested_empty": {"a": {"b": {}}},
    }


# -- wire format ---------------------------------------------------------------

def test_roundtrip_nested_tensors_and_scalars():
    state = sample_state()
    got = roundtrip(state)
    assert_same_state(got, state)


def test_roundtrip_keeps_bool_distinct_from_int():
    got = roundtrip({"t": True, "one": 1, "f": 1.0})
    assert got["t"] is True and type(got["one"]) is int and type(got["f"]) is float


def test_roundtrip_of_empty_root_and_scalar_only_state():
    assert roundtrip({}) == {}
    assert roundtrip({"step": 5, "name": "x"}) == {"step": 5, "name": "x"}


def test_non_contiguous_and_view_tensors_roundtrip_with_their_values():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state = {
        "transposed": base.t(),
        "strided": base[:, ::2],
        "narrow": base.narrow(1, 2, 3),
        "expanded": torch.tensor([1.0, 2.0]).expand(3, 2),
        "row_view": base[1],
        "same_storage_a": base[0],
        "same_storage_b": base[0],
    }
    assert not state["transposed"].is_contiguous()
    got = roundtrip(state)
    for key, tensor in state.items():
        assert got[key].is_contiguous()
        assert got[key].shape == tensor.shape
        assert torch.equal(got[key], tensor), key
    # The receiver gets independent tensors: writing one does not change another.
    got["same_storage_a"].zero_()
    assert torch.equal(got["same_storage_b"], base[0])


def test_requires_grad_tensor_is_sent_detached():
    p = torch.nn.Parameter(torch.randn(3))
    got = roundtrip({"p": p})
    assert not got["p"].requires_grad and torch.equal(got["p"], p.detach())


def test_encoded_layout_is_length_json_safetensors():
    body = encode_state({"a": {"b": torch.ones(2)}, "s": 3})
    (n,) = struct.unpack("<Q", body[:8])
    header = json.loads(body[8:8 + n])
    assert header == {"a/b": {"t": "t0"}, "s": {"v": 3}}
    assert torch.equal(st_load(body[8 + n:])["t0"], torch.ones(2))


@pytest.mark.parametrize("leaf, type_name", [
    (object(), "object"),
    ((1, 2), "tuple"),
    ([torch.ones(1)], "list"),
    (b"bytes", "bytes"),
    (1 + 2j, "complex"),
    ({1, 2}, "set"),
])
def test_non_tensor_object_leaf_raises_type_error_naming_the_path(leaf, type_name):
    state = {"optim": {"param_groups": {"0": {"betas": leaf}}}, "ok": torch.ones(1)}
    with pytest.raises(TypeError) as err:
        encode_state(state)
    msg = str(err.value)
    assert "'optim/param_groups/0/betas'" in msg and type_name in msg


@pytest.mark.parametrize("bad_key", [0, ("a",), "a/b"])
def test_keys_must_be_strings_without_separator(bad_key):
    with pytest.raises(TypeError) as err:
        encode_state({"outer": {bad_key: 1}})
    assert repr(bad_key) in str(err.value) and "'outer'" in str(err.value)


class _Marker:
    """Unpickling this would create a file: proof that code ran."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("protocol", range(0, pickle.HIGHEST_PROTOCOL + 1))
def test_pickle_payload_is_refused_without_running_code(tmp_path, protocol):
    marker = tmp_path / "pwned"
    payload = pickle.dumps({"state": _Marker(str(marker))}, protocol=protocol)
    # Sanity: the payload really is armed.
    pickle.loads(payload).get("state").close()
    assert marker.exists()
    marker.unlink()

    with pytest.raises(ValueError):
        decode_state(payload)
    assert not marker.exists()


def test_pickle_in_blob_or_header_position_never_runs_code(tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Marker(str(marker)))
    head_with_tensor = b'{"x": {"t": "t0"}}'
    bodies = [
        struct.pack("<Q", 2) + b"{}" + payload,                         # pickle as the safetensors blob
        struct.pack("<Q", len(head_with_tensor)) + head_with_tensor + payload,
        struct.pack("<Q", len(payload)) + payload,                       # pickle as the header
        b"PK\x03\x04" + b"\x00" * 4 + payload,                           # torch.save zip magic in front
    ]
    for body in bodies:
        with pytest.raises(ValueError):
            decode_state(body)
        assert not marker.exists()


@pytest.mark.parametrize("body, needle", [
    (b"", "0 bytes is truncated"),
    (b"\x01\x02\x03", "3 bytes is truncated"),
    (struct.pack("<Q", 100) + b"{}", "header of 100 bytes exceeds body of 10 bytes"),
    (struct.pack("<Q", 2 ** 64 - 1) + b"{}", "exceeds body"),
    (struct.pack("<Q", 5) + b"{not json", "not JSON"),
    (struct.pack("<Q", 2) + b"\xff\xfe", None),
])
def test_truncated_or_foreign_body_raises_value_error(body, needle):
    with pytest.raises(ValueError, match=needle):
        decode_state(body)


def test_truncated_header_of_a_real_body_raises_value_error():
    body = encode_state({"a": torch.ones(3), "b": 1})
    (n,) = struct.unpack("<Q", body[:8])
    for cut in (0, 7, 8, 8 + n // 2):
        with pytest.raises(ValueError):
            decode_state(body[:cut])


def _malformed_bodies():
    good = encode_state({"a": torch.arange(8.0), "b": 1})
    (n,) = struct.unpack("<Q", good[:8])

    def framed(head: bytes, blob: bytes = b"") -> bytes:
        return struct.pack("<Q", len(head)) + head + blob

    return {
        "truncated_blob": good[:-3],
        "blob_cut_after_its_header": good[: 8 + n + 20],
        "garbage_blob": framed(b'{"a": {"t": "t0"}}', b"garbage-bytes-not-safetensors"),
        "header_is_a_list": framed(b"[1, 2]"),
        "entry_not_an_object": framed(b'{"a": 5}'),
        "entry_without_kind": framed(b'{"a": {}}'),
        "tensor_not_in_blob": framed(b'{"a": {"t": "t0"}}'),
    }


_MALFORMED = _malformed_bodies()


@pytest.mark.parametrize("name", sorted(_MALFORMED))
def test_malformed_body_with_valid_framing_raises_value_error(name):
    try:
        decode_state(_MALFORMED[name])
    except ValueError:
        return
    except Exception as e:
        raise AssertionError(f"{name}: {type(e).__name__}: {e}") from e
    raise AssertionError(f"{name}: decoded without error")


def test_empty_string_key_at_root_survives_or_is_refused():
    state = {"": {"x": 1}}
    try:
        got = roundtrip(state)
    except TypeError:
        return
    assert got == state


# -- HTTP transport --------------------------------------------------------------

@pytest.fixture(scope="module")
def _shared_transport():
    # One server for the module: each shutdown waits out serve_forever's 0.5 s poll interval.
    t = SafeHTTPTransport("127.0.0.1", timeout=timedelta(seconds=1), max_recv_bytes=_bound)
    yield t
    t.shutdown()


@pytest.fixture
def transport(_shared_transport):
    """The shared transport, serving nothing at the start and end of each test."""
    _shared_transport.disallow_checkpoint()
    yield _shared_transport
    _shared_transport.disallow_checkpoint()


def _get(url, timeout=5.0):
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.status, resp.read()


def test_transport_implements_torchft_interface(transport):
    assert isinstance(transport, CheckpointTransport)


@NET_TIMEOUT
def test_binds_only_the_given_interface(transport):
    host, port = transport._server.socket.getsockname()[:2]
    assert host == "127.0.0.1" and host != "0.0.0.0"
    assert port > 0
    assert transport.metadata() == f"http://127.0.0.1:{port}/heal/"


@NET_TIMEOUT
def test_bind_ipv6_loopback_uses_bracketed_metadata():
    if not socket.has_ipv6:
        pytest.skip("no IPv6 support")
    try:
        t = SafeHTTPTransport("::1", timeout=timedelta(seconds=1), max_recv_bytes=_bound)
    except OSError as e:
        pytest.skip(f"no IPv6 loopback here: {e}")
    try:
        host, port = t._server.socket.getsockname()[:2]
        assert host == "::1"
        assert t.metadata() == f"http://[::1]:{port}/heal/"
        t.send_checkpoint([1], 3, {"x": torch.ones(2)}, timedelta(seconds=1))
        got = t.recv_checkpoint(0, t.metadata(), 3, timedelta(seconds=5))
        assert torch.equal(got["x"], torch.ones(2))
    finally:
        t.shutdown()


@NET_TIMEOUT
def test_bind_to_foreign_address_raises_oserror():
    with pytest.raises(OSError):
        SafeHTTPTransport("192.0.2.1", timeout=timedelta(seconds=1), max_recv_bytes=_bound)  # TEST-NET-1: never local


@NET_TIMEOUT
def test_serves_state_to_a_receiver(transport):
    state = sample_state()
    transport.send_checkpoint([1, 2], step=12, state_dict=state, timeout=timedelta(seconds=5))
    got = transport.recv_checkpoint(src_rank=0, metadata=transport.metadata(), step=12,
                                    timeout=timedelta(seconds=5))
    assert_same_state(got, state)


@NET_TIMEOUT
def test_receiver_in_another_transport_fetches_state(transport):
    other = SafeHTTPTransport("127.0.0.1", timeout=timedelta(seconds=1), max_recv_bytes=_bound)
    try:
        state = {"w": torch.randn(256, 256), "step": 4}  # 256 KiB: several TCP segments
        transport.send_checkpoint([1], 4, state, timedelta(seconds=5))
        got = other.recv_checkpoint(0, transport.metadata(), 4, timedelta(seconds=5))
        assert torch.equal(got["w"], state["w"]) and got["step"] == 4
    finally:
        other.shutdown()


@NET_TIMEOUT
def test_concurrent_receivers_all_get_the_state(transport):
    state = {"w": torch.randn(64, 64)}
    transport.send_checkpoint([1, 2, 3], 9, state, timedelta(seconds=5))
    results, errors = [None] * 3, []

    def fetch(i):
        try:
            results[i] = transport.recv_checkpoint(0, transport.metadata(), 9, timedelta(seconds=5))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=fetch, args=(i,)) for i in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=10)
    assert not errors
    assert all(torch.equal(r["w"], state["w"]) for r in results)


class _WaitSignallingCondition(threading.Condition):
    """A Condition that reports when some thread starts waiting on it."""

    def __init__(self):
        super().__init__()
        self.someone_waits = threading.Event()

    def wait(self, timeout=None):
        self.someone_waits.set()
        return super().wait(timeout)


@NET_TIMEOUT
def test_request_arriving_before_send_waits_for_it():
    t = SafeHTTPTransport("127.0.0.1", timeout=timedelta(seconds=10), max_recv_bytes=_bound)
    t._cond = _WaitSignallingCondition()
    try:
        out = {}

        def fetch():
            out["state"] = t.recv_checkpoint(0, t.metadata(), 5, timedelta(seconds=10))

        th = threading.Thread(target=fetch)
        th.start()
        assert t._cond.someone_waits.wait(timeout=10), "the request never reached the server"
        t.send_checkpoint([1], 5, {"x": torch.full((3,), 5.0)}, timedelta(seconds=5))
        th.join(timeout=10)
        assert not th.is_alive()
        assert torch.equal(out["state"]["x"], torch.full((3,), 5.0))
    finally:
        t.shutdown()


@NET_TIMEOUT
def test_request_for_an_older_step_fails_at_once(transport):
    transport.send_checkpoint([1], 7, {"x": torch.ones(1)}, timedelta(seconds=5))
    t0 = time.monotonic()
    with pytest.raises(urllib.error.HTTPError) as err:
        transport.recv_checkpoint(0, transport.metadata(), 6, timedelta(seconds=5))
    assert err.value.code == 409
    assert time.monotonic() - t0 < 0.9  # refused, not timed out (the server waits 1 s at most)


@NET_TIMEOUT
def test_request_for_a_newer_step_fails_after_the_server_timeout(transport):
    transport.send_checkpoint([1], 7, {"x": torch.ones(1)}, timedelta(seconds=5))
    t0 = time.monotonic()
    with pytest.raises(OSError):  # 409 from the server (HTTPError is an OSError) or a client timeout
        transport.recv_checkpoint(0, transport.metadata(), 8, timedelta(seconds=5))
    assert time.monotonic() - t0 < 4.5


@NET_TIMEOUT
def test_disallow_checkpoint_stops_serving_the_old_state(transport):
    transport.send_checkpoint([1], 3, {"x": torch.ones(2)}, timedelta(seconds=5))
    assert torch.equal(transport.recv_checkpoint(0, transport.metadata(), 3, timedelta(seconds=5))["x"],
                       torch.ones(2))
    transport.disallow_checkpoint()
    t0 = time.monotonic()
    with pytest.raises(OSError):
        transport.recv_checkpoint(0, transport.metadata(), 3, timedelta(seconds=1))
    assert time.monotonic() - t0 < 4.5


@NET_TIMEOUT
def test_disallow_then_new_send_serves_only_the_new_state(transport):
    transport.send_checkpoint([1], 3, {"x": torch.zeros(2)}, timedelta(seconds=5))
    transport.disallow_checkpoint()
    transport.send_checkpoint([1], 4, {"x": torch.ones(2)}, timedelta(seconds=5))
    got = transport.recv_checkpoint(0, transport.metadata(), 4, timedelta(seconds=5))
    assert torch.equal(got["x"], torch.ones(2))
    with pytest.raises(urllib.error.HTTPError):
        transport.recv_checkpoint(0, transport.metadata(), 3, timedelta(seconds=5))


@NET_TIMEOUT
def test_a_second_send_of_the_step_being_served_keeps_the_first(transport):
    # ReplicaManager serves a donor's state as soon as the quorum names it (before torchft reconfigures);
    # torchft's own send_checkpoint for that step must then neither replace nor re-lay out the body.
    transport.send_checkpoint([1], 3, {"x": torch.ones(2)}, timedelta(seconds=5))
    transport.send_checkpoint([1], 3, {"x": torch.zeros(3)}, timedelta(seconds=5))
    got = transport.recv_checkpoint(0, transport.metadata(), 3, timedelta(seconds=5))
    assert torch.equal(got["x"], torch.ones(2))


@NET_TIMEOUT
def test_send_of_a_pickle_only_leaf_raises_type_error(transport):
    with pytest.raises(TypeError, match="'scaler'"):
        transport.send_checkpoint([1], 1, {"scaler": object()}, timedelta(seconds=1))


@NET_TIMEOUT
@pytest.mark.parametrize("path", ["/", "/heal", "/heal/", "/heal/abc", "/heal/-1", "/heal/1/2", "/other/1",
                                  "/heal/1.5"])
def test_bad_path_returns_404(transport, path):
    transport.send_checkpoint([1], 1, {"x": torch.ones(1)}, timedelta(seconds=1))
    base = transport.metadata()[: -len("/heal/")]
    with pytest.raises(urllib.error.HTTPError) as err:
        _get(base + path)
    assert err.value.code == 404


@NET_TIMEOUT
def test_get_returns_the_encoded_body(transport):
    state = {"x": torch.arange(3), "n": 2}
    transport.send_checkpoint([1], 2, state, timedelta(seconds=1))
    status, body = _get(transport.metadata() + "2")
    assert status == 200 and body == encode_state(state)


@NET_TIMEOUT
def test_shutdown_closes_the_port():
    t = SafeHTTPTransport("127.0.0.1", timeout=timedelta(seconds=1), max_recv_bytes=_bound)
    port = t._server.socket.getsockname()[1]
    t.send_checkpoint([1], 1, {"x": torch.ones(1)}, timedelta(seconds=1))
    t.shutdown()
    assert not t._thread.is_alive()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


@NET_TIMEOUT
def test_receiver_refuses_a_pickle_served_by_a_hostile_donor(tmp_path):
    """A donor (or anyone answering on its address) serving a pickle cannot run code on the joiner."""
    marker = tmp_path / "pwned"
    payload = pickle.dumps({"w": _Marker(str(marker))})

    class Hostile(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    receiver = SafeHTTPTransport("127.0.0.1", timeout=timedelta(seconds=1), max_recv_bytes=_bound)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/heal/"
        with pytest.raises(ValueError):
            receiver.recv_checkpoint(0, url, 1, timedelta(seconds=5))
        assert not marker.exists()
    finally:
        receiver.shutdown()
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@NET_TIMEOUT
def test_recv_from_a_dead_donor_raises_oserror():
    t = SafeHTTPTransport("127.0.0.1", timeout=timedelta(seconds=1), max_recv_bytes=_bound)
    address = t.metadata()
    t.shutdown()
    with pytest.raises(OSError):
        t.recv_checkpoint(0, address, 1, timedelta(seconds=2))


@NET_TIMEOUT
@pytest.mark.parametrize("method", ["POST", "PUT"])
def test_pickle_sent_to_the_transport_is_refused_and_changes_nothing(transport, tmp_path, method):
    """The heal server only answers GET: a pickle pushed at it is refused unread, and serving goes on."""
    marker = tmp_path / "pwned"
    payload = pickle.dumps({"w": _Marker(str(marker))})
    state = {"x": torch.arange(3.0)}
    transport.send_checkpoint([1], 4, state, timedelta(seconds=5))
    url = f"{transport.metadata()}4"
    request = urllib.request.Request(url, data=payload, method=method,
                                     headers={"Content-Type": "application/octet-stream"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=5)
    assert err.value.code == 501
    assert not marker.exists()
    got = transport.recv_checkpoint(0, transport.metadata(), 4, timedelta(seconds=5))
    assert torch.equal(got["x"], state["x"])


@NET_TIMEOUT
def test_bound_socket_is_the_chosen_interface_only():
    """Bound to 127.0.0.2, the port is closed on 127.0.0.1 (another address of the same machine)."""
    try:
        t = SafeHTTPTransport("127.0.0.2", timeout=timedelta(seconds=1), max_recv_bytes=_bound)
    except OSError as e:
        pytest.skip(f"127.0.0.2 not usable here: {e}")
    try:
        host, port = t._server.socket.getsockname()[:2]
        assert host == "127.0.0.2"
        socket.create_connection(("127.0.0.2", port), timeout=2).close()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
    finally:
        t.shutdown()


def test_encoded_body_is_a_snapshot_of_the_state():
    # The donor's state changes once its step goes on: the served body must not.
    flat = torch.arange(6.0)
    body = encode_state({"a": flat[:3], "b": flat[3:], "whole": flat})
    flat.zero_()
    got = decode_state(body)
    assert torch.equal(got["a"], torch.arange(3.0)) and torch.equal(got["b"], torch.arange(3.0, 6.0))
    assert torch.equal(got["whole"], torch.arange(6.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                                   torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool])
def test_received_blob_decodes_as_writable_views_equal_to_safetensors_load(dtype):
    from ftbridge.manager.transport import decode_parts

    state = {"a": (torch.arange(12) % 3).to(dtype).reshape(3, 4), "empty": torch.empty(0, 5, dtype=dtype),
             "s": 7, "nested": {"b": torch.ones(2, dtype=dtype)}}
    body = encode_state(state)
    (n,) = struct.unpack("<Q", body[:8])
    head, blob = body[8:8 + n], body[8 + n:]
    copied = decode_parts(head, blob)  # bytes: safetensors.torch.load
    viewed = decode_parts(head, bytearray(blob))  # bytearray: views of the received buffer
    for got in (copied, viewed):
        assert torch.equal(got["a"], state["a"]) and got["a"].dtype == dtype and got["s"] == 7
        assert got["empty"].shape == (0, 5) and torch.equal(got["nested"]["b"], state["nested"]["b"])
    viewed["a"].zero_()  # writable, and only its own bytes change
    assert torch.equal(viewed["nested"]["b"], state["nested"]["b"])


@pytest.mark.parametrize("corrupt", ["offsets past the end", "size mismatch"])
def test_view_decode_checks_offsets_against_the_blob(corrupt):
    from ftbridge.manager.transport import decode_parts

    body = encode_state({"a": torch.arange(4.0)})
    (n,) = struct.unpack("<Q", body[:8])
    head, blob = body[8:8 + n], body[8 + n:]
    (m,) = struct.unpack("<Q", blob[:8])
    st_head = json.loads(blob[8:8 + m])
    st_head["t0"]["data_offsets"] = [0, 10_000] if corrupt == "offsets past the end" else [0, 12]
    new = json.dumps(st_head).encode()
    with pytest.raises(ValueError, match="data_offsets"):
        decode_parts(head, bytearray(struct.pack("<Q", len(new)) + new + blob[8 + m:]))
