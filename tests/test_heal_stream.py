"""The streamed heal body (ftbridge.heal.stream) and the joiner's receive path around it.

Unit tests drive :class:`StreamBody` with an in-memory ``send``; the HTTP
tests run donor and joiner transports in this process with short timeouts.
"""

import socket
import threading
import time
from datetime import timedelta

import pytest
import torch
from safetensors.torch import load as st_load

from ftbridge.heal import stream
from ftbridge.heal.stream import BodyAborted, ReceiveBuffer, StreamBody
from ftbridge.heal.wire import decode_state, encode_state, header_length, plan_body
from ftbridge.manager import transport as transport_mod
from ftbridge.manager.transport import SafeHTTPTransport
from ftbridge.staging import Staging


def _bound() -> int:
    """The largest heal body a transport in these tests accepts: 64 MiB."""
    return 64 << 20

pytestmark = pytest.mark.timeout(30)


def _state():
    flat = torch.arange(40, dtype=torch.float32)  # views of one flat buffer, as ZeRO's state dicts hold
    return {
        "optimizer": {"fp32": flat, "exp_avg": flat[:10], "exp_avg_sq": flat[10:30].view(4, 5),
                      "step": torch.tensor(3, dtype=torch.int64), "lr": 0.5},
        "bf16": torch.randn(7, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16),
        "transposed": torch.arange(6.0).view(2, 3).t(),  # not contiguous: sent from a private copy
        "empty": torch.empty(0), "mask": torch.tensor([True, False]),
        "counters": {"global_steps": 12, "name": "x", "none": None}, "nothing": {},
    }


@pytest.fixture(params=["host", "staged"])
def staging(request):
    """``None`` (host tensors sent from their memory), or a 24-byte buffer that CPU tensors go through as a
    GPU's do (``stage_cpu``): many copies per tensor."""
    if request.param == "host":
        return None
    s = Staging(24, pin=False)
    s.stage_cpu = True
    return s


class Sink:
    """``send`` for :meth:`StreamBody.serve`: takes at most ``cap`` bytes per call, like a partial socket send."""

    def __init__(self, cap=1 << 40):
        self.data, self.cap, self.calls = bytearray(), cap, 0

    def __call__(self, views):
        self.calls += 1
        room = self.cap
        for v in views:
            part = bytes(v[:room])
            self.data += part
            room -= len(part)
            if not room:
                break
        return self.cap - room


def _serve(body, **kw):
    sink = kw.pop("sink", Sink())
    body.serve(sink, cut=lambda: None, **kw)
    return bytes(sink.data)


def assert_states_equal(got, want):
    assert set(got) == set(want)
    for k, w in want.items():
        if isinstance(w, dict):
            assert_states_equal(got[k], w)
        elif isinstance(w, torch.Tensor):
            assert got[k].dtype == w.dtype and torch.equal(got[k], w.contiguous())
        else:
            assert got[k] == w and type(got[k]) is type(w)


# -- the body on the wire -------------------------------------------------------------------------

@pytest.mark.parametrize("cap", [1 << 40, 7, 4096])
def test_streamed_body_is_the_encoded_body_and_decodes_to_the_state(cap, monkeypatch, staging):
    monkeypatch.setattr(stream, "SEND_CHUNK_BYTES", 24)  # many sends, crossing tensor boundaries
    state = _state()
    body = StreamBody(plan_body(state), staging=staging)
    wire = _serve(body, sink=Sink(cap))
    assert len(wire) == body.size and wire == encode_state(state)
    assert_states_equal(decode_state(bytearray(wire)), state)
    if staging is not None:  # every tensor byte went through the buffer, which did not grow
        tensors = [t for t in plan_body(state).tensors]
        assert staging.chunks_moved == sum(-(-t.numel() * t.element_size() // 24) for t in tensors) > len(tensors)
        assert staging.buffer().numel() == 24


def test_a_device_tensor_needs_a_staging_buffer():
    plan = plan_body({"w": torch.zeros(3, device="meta")})
    with pytest.raises(ValueError, match="needs a staging buffer"):
        StreamBody(plan)


def test_the_blob_is_a_safetensors_file_that_safetensors_itself_loads():
    state = _state()
    wire = encode_state(state)
    n = header_length(wire[:8], len(wire))
    loaded = st_load(wire[8 + n:])
    assert len(loaded) == 8 and torch.equal(loaded["t0"], state["optimizer"]["fp32"])


def test_headers_and_a_small_body_go_out_in_one_send():
    sink = Sink()
    body = StreamBody(plan_body(_state()))
    body.serve(sink, cut=lambda: None, head=b"HTTP/1.0 200 OK\r\n\r\n")
    assert sink.calls == 1 and sink.data.startswith(b"HTTP/1.0 200 OK\r\n\r\n")


def test_halfway_stops_the_first_sends_at_half_the_body():
    seen = []
    body = StreamBody(plan_body({"w": torch.randn(10_000)}))
    sink = Sink()
    body.serve(sink, cut=lambda: None, halfway=lambda: seen.append(len(sink.data)))
    assert seen == [body.size // 2]


# -- the snapshot: disallow_checkpoint freezes the body --------------------------------------------

def test_after_freeze_a_response_in_flight_sends_the_state_as_it_was(monkeypatch, staging):
    monkeypatch.setattr(stream, "SEND_CHUNK_BYTES", 16)
    state = _state()
    want = encode_state(state)
    body = StreamBody(plan_body(state), staging=staging)
    paused, go, out = threading.Event(), threading.Event(), {}

    def halfway():  # between two sends: nothing of the live state is being written
        paused.set()
        assert go.wait(10)

    sender = threading.Thread(target=lambda: out.update(wire=_serve(body, halfway=halfway)))
    sender.start()
    assert paused.wait(10)
    assert body.freeze(wait_s=5)
    state["optimizer"]["fp32"].fill_(-1.0)  # the donor's optimizer step
    state["bf16"].zero_()
    go.set()
    sender.join(10)
    assert out["wire"] == want and 0 < body.staged_bytes < body.size // 2 + 16


def test_a_response_starting_after_freeze_is_refused_not_sent_from_the_changed_state():
    body = StreamBody(plan_body(_state()))
    assert body.freeze()
    with pytest.raises(BodyAborted):
        _serve(body)


def test_freeze_cuts_off_a_response_stuck_in_a_send_from_the_live_state():
    body = StreamBody(plan_body(_state()))
    in_send, cut = threading.Event(), threading.Event()
    errors = []

    def stuck_send(views):  # a joiner that stopped reading: the send blocks until the socket is shut down
        in_send.set()
        assert cut.wait(10)
        raise OSError("socket shut down")

    def serve():
        try:
            body.serve(stuck_send, cut=cut.set)
        except OSError as e:
            errors.append(e)

    sender = threading.Thread(target=serve)
    sender.start()
    assert in_send.wait(10)
    t0 = time.monotonic()
    assert body.freeze(wait_s=0.2)
    assert cut.is_set() and time.monotonic() - t0 < 5
    sender.join(10)
    assert len(errors) == 1


# -- the joiner's receive buffer ----------------------------------------------------------------

def test_a_receive_buffer_is_touched_in_the_background_and_taken_once_if_large_enough():
    buf = ReceiveBuffer(3 << 20)
    assert buf.wait(10)
    assert buf.take(4 << 20, time.monotonic() + 1) is None  # too small: the fetch allocates instead
    view = buf.take(1 << 20, time.monotonic() + 1)
    assert len(view) == 1 << 20 and not view.readonly
    with pytest.raises(ValueError):
        ReceiveBuffer(-1)


@pytest.fixture(scope="module")
def pair():
    donor = SafeHTTPTransport("127.0.0.1", timedelta(seconds=2), max_recv_bytes=_bound)
    joiner = SafeHTTPTransport("127.0.0.1", timedelta(seconds=2), heal_timeout=timedelta(seconds=5),
                               max_recv_bytes=lambda: 1 << 20)
    yield donor, joiner
    joiner.shutdown()
    donor.shutdown()


def test_a_fetch_receives_into_the_prepared_buffer(pair, monkeypatch):
    donor, joiner = pair
    state = _state()
    donor.send_checkpoint([1], 11, state, timedelta(seconds=2))
    try:
        joiner.prepare_recv(wait_s=10)
        monkeypatch.setattr(transport_mod, "fresh_buffer", lambda n: pytest.fail("allocated instead of prepared"))
        got = joiner.recv_checkpoint(0, donor.metadata(), 11, timedelta(seconds=5))
    finally:
        donor.disallow_checkpoint()
    assert_states_equal(got, state)
    assert joiner._recv_buffer is None  # used once


def test_a_large_body_arriving_in_pieces_is_received_whole(pair):
    donor, joiner = pair
    state = {"w": torch.randn(200_000)}  # 800 kB: many segments on the loopback socket
    donor.send_checkpoint([1], 12, state, timedelta(seconds=2))
    try:
        got = joiner.recv_checkpoint(0, donor.metadata(), 12, timedelta(seconds=5))
    finally:
        donor.disallow_checkpoint()
    assert torch.equal(got["w"], state["w"])


def test_a_body_cut_short_by_the_donor_is_refused(pair):
    _, joiner = pair
    wire = encode_state({"w": torch.randn(50_000)})
    server = socket.create_server(("127.0.0.1", 0))

    def donor():  # announces the whole body, sends 3/4 of it in two pieces, then closes
        conn, _ = server.accept()
        with conn:
            conn.recv(4096)
            conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % len(wire) + wire[:1000])
            conn.sendall(wire[1000 : len(wire) * 3 // 4])

    th = threading.Thread(target=donor, daemon=True)
    th.start()
    try:
        with pytest.raises(ConnectionError, match=f"received {len(wire) * 3 // 4} of {len(wire)} bytes"):
            joiner.recv_checkpoint(0, f"http://127.0.0.1:{server.getsockname()[1]}/heal/", 1,
                                   timedelta(seconds=5))
    finally:
        th.join(5)
        server.close()


def test_an_oversize_claim_is_refused_before_any_buffer_is_taken_or_allocated(pair, monkeypatch):
    _, joiner = pair
    taken = []
    monkeypatch.setattr(joiner, "_take_recv_buffer", lambda n, d: taken.append(n))
    server = socket.create_server(("127.0.0.1", 0))

    def donor():
        conn, _ = server.accept()
        with conn:
            conn.recv(4096)
            conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % (2 << 20) + b"\0" * 64)

    th = threading.Thread(target=donor, daemon=True)
    th.start()
    try:
        with pytest.raises(ValueError, match="refused before allocating"):
            joiner.recv_checkpoint(0, f"http://127.0.0.1:{server.getsockname()[1]}/heal/", 1,
                                   timedelta(seconds=5))
    finally:
        th.join(5)
        server.close()
    assert taken == []


@pytest.mark.parametrize("staged", [False, True], ids=["host", "staged"])
def test_disallow_during_a_fetch_still_delivers_the_snapshot(pair, monkeypatch, staged):
    donor, joiner = pair
    donor._staging.stage_cpu = staged  # a GPU donor's path: through the staging buffer, not waited for
    monkeypatch.setattr(stream, "SEND_CHUNK_BYTES", 64 << 10)
    state = {"w": torch.randn(200_000)}
    want = state["w"].clone()
    donor.send_checkpoint([1], 13, state, timedelta(seconds=2))
    out = {}

    def fetch():
        try:
            out["got"] = joiner.recv_checkpoint(0, donor.metadata(), 13, timedelta(seconds=5))
        except OSError as e:  # a short body (ConnectionError): no state
            out["error"] = e

    handed_out, wait_for = threading.Event(), donor._wait_for
    monkeypatch.setattr(donor, "_wait_for", lambda step: (wait_for(step), handed_out.set())[0])
    th = threading.Thread(target=fetch)
    th.start()
    assert handed_out.wait(5)  # the handler holds the body: it serves it from here, or is cut short
    donor.disallow_checkpoint()
    state["w"].fill_(7.0)
    th.join(10)
    # Either the whole snapshot arrived, or the response was cut short: never a mix of old and new bytes.
    assert ("got" in out) != ("error" in out)
    if "got" in out:
        assert torch.equal(out["got"]["w"], want)


def test_serving_lowers_the_gil_switch_interval_until_disallow(pair):
    import sys

    donor, _ = pair
    before = sys.getswitchinterval()
    donor.send_checkpoint([1], 14, {"w": torch.zeros(3)}, timedelta(seconds=2))
    try:
        assert sys.getswitchinterval() == pytest.approx(transport_mod.SERVING_SWITCH_INTERVAL_S)
    finally:
        donor.disallow_checkpoint()
    assert sys.getswitchinterval() == pytest.approx(before)


# -- the engine: a restarted group prepares its receive and fetches alone ----------------------------

@pytest.mark.usefixtures("single_rank_world")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("restart_count, prepared", [("1", True), ("0", False)])
def test_a_restarted_group_maps_its_receive_buffer_and_fetches_before_its_first_forward(monkeypatch, restart_count,
                                                                                          prepared):
    from types import SimpleNamespace

    from tests.fakes import FakeManager, gpt_batch, tiny_engine

    calls = []
    transport = SimpleNamespace(prepare_recv=lambda: calls.append("prepare"),
                                release_recv=lambda: calls.append("release"))

    class Manager(FakeManager):
        participants = 2  # a peer is there: the restarted group does not wait for one (heal.must_wait_for_peer)

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.transport = transport

        def wait_quorum(self):
            calls.append("wait_quorum")

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restart_count)
    engine = tiny_engine(2, manager=Manager, ft={"num_replica_groups": 2})
    try:
        assert calls == (["prepare"] if prepared else [])
        for i in range(2):
            _, loss = engine(*gpt_batch(i))
            engine.backward(loss)
            engine.step()
        # Waits for the first step's quorum only; the buffer goes at the first commit.
        assert calls == (["prepare", "wait_quorum", "release"] if prepared else [])
    finally:
        engine.shutdown()
