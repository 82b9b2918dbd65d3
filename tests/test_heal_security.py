"""The heal path under attack (issue 17): hostile and slow donors, idle and non-reading clients, URLs, proxies, tokens.

Donor and joiner run in this process (servers in threads); every test has a
short timeout. Hostile peers are raw sockets driven by a thread; where a test
waits for the other side it waits on an event or a condition, never on a
fixed sleep.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
import tracemalloc
import urllib.error
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

from ftbridge.config import FTBridgeConfig
from ftbridge.heal import lazy_state_bytes, limits
from ftbridge.heal.wire import encode_state, size_bound
from ftbridge.manager import ReplicaManager
from ftbridge.manager.transport import SafeHTTPTransport


def _bound() -> int:
    """The largest heal body a transport in these tests accepts: 64 MiB."""
    return 64 << 20

pytestmark = pytest.mark.timeout(30)
TOKEN = "0123456789abcdef-job-secret"


class RawDonor:
    """A TCP server on 127.0.0.1 that reads one request head per connection and hands the socket to ``behave``.

    ``requests`` counts connections; ``stop`` ends any paced sending.
    """

    def __init__(self, behave):
        self.behave, self.requests, self.heads = behave, 0, []
        self.stop = threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/heal/"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.requests += 1
            with conn:
                head = b""
                while b"\r\n\r\n" not in head:
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    head += chunk
                self.heads.append(head)
                try:
                    self.behave(self, conn)
                except OSError:
                    pass

    def close(self):
        self.stop.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        except OSError:
            pass
        self.sock.close()
        self.thread.join(timeout=5)


@pytest.fixture
def raw_donor():
    donors = []

    def make(behave):
        donors.append(RawDonor(behave))
        return donors[-1]

    yield make
    for d in donors:
        d.close()


@pytest.fixture(scope="module")
def _joiner():
    # One for the module: each shutdown waits out serve_forever's 0.5 s poll interval.
    t = SafeHTTPTransport("127.0.0.1", timeout=timedelta(seconds=1), heal_timeout=timedelta(seconds=1),
                          max_recv_bytes=lambda: 1 << 20)
    yield t
    t.shutdown()


@pytest.fixture
def joiner(_joiner):
    """A joiner accepting at most 1 MiB, with a 1 s heal deadline, any donor host."""
    _joiner.expect_donor(None)
    yield _joiner
    _joiner.expect_donor(None)


HOSTILE_23 = struct.pack("<Q", 2) + b"{}" + b"x" * 13  # 23 bytes with a valid frame: only the claim is a lie


def _claim(size, payload=HOSTILE_23):
    def behave(donor, conn):
        conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % size + payload)
    return behave


# -- hostile donor: the claimed size ------------------------------------------------------------

@pytest.mark.parametrize("claimed", [3 << 30, 1 << 40])
def test_a_claimed_body_above_the_joiners_bound_is_refused_before_allocating(raw_donor, joiner, claimed):
    donor = raw_donor(_claim(claimed))
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="refused before allocating"):
            joiner.recv_checkpoint(0, donor.url, 1, timedelta(seconds=5))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"{peak} bytes allocated for a {claimed}-byte claim"


def test_the_bound_of_a_real_state_admits_its_own_body_and_the_donors_lazy_adam_state():
    # A torch optimizer's shape (param_groups, state keyed by parameter), without importing torch.optim (4 s here).
    params = [torch.randn(512, 1024), torch.randn(11)]  # 2 MiB
    fresh = SimpleNamespace(param_groups=[{"params": params, "lr": 0.1}], state={})  # a joiner before its first step
    adam = {i: {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
            for i, p in enumerate(params)}  # what AdamW's first step creates
    stepped = SimpleNamespace(param_groups=fresh.param_groups, state=dict(zip(params, adam.values())))
    groups = {"0": {"lr": 0.1, "params": {"0": 0, "1": 1}}}
    own = {"optimizer": {"state": {}, "param_groups": groups}}
    donor = {"optimizer": {"state": {str(i): v for i, v in adam.items()}, "param_groups": groups}}
    assert len(encode_state(own)) <= size_bound(own)
    assert len(encode_state(donor)) > size_bound(own)  # why the lazy allowance exists
    assert len(encode_state(donor)) <= size_bound(own, extra_bytes=lazy_state_bytes(fresh))
    assert lazy_state_bytes(stepped) == 0 and lazy_state_bytes(None) == 0


_DS_BOUND = """
import os, sys
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import torch, deepspeed, torch.distributed as dist
from ftbridge.zero.stages import adapter_for
from ftbridge.heal import lazy_state_bytes
from ftbridge.heal.wire import encode_state, size_bound
dist.init_process_group("gloo")
for stage, bf16 in ((1, True), (2, False), (3, False)):
    torch.manual_seed(0)
    # 0.5 M parameters: Adam's moments (4 MB) exceed the bound's 1 MiB header slack
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 8))
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}}
    if bf16:
        cfg.update(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"})
    # torch's AdamW (DeepSpeed's own "AdamW" type JIT-builds its CPU Adam op: ~30 s of this test)
    eng, *_ = deepspeed.initialize(model=model, config=cfg, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    ad = adapter_for(eng)
    fresh = {"optimizer": ad.heal_state()}
    bound = size_bound(fresh, extra_bytes=lazy_state_bytes(ad.optimizer))
    eng.backward(eng(torch.randn(2, 512, dtype=torch.bfloat16 if bf16 else torch.float32)).float().sum())
    eng.step()
    stepped = len(encode_state({"optimizer": ad.heal_state()}))
    print("RESULT", type(ad.optimizer).__name__, len(encode_state(fresh)), stepped, bound, flush=True)
"""


@pytest.mark.timeout(180)
def test_a_fresh_joiners_bound_admits_a_stepped_donors_state_for_every_zero_stage(tmp_path):
    """DeepSpeed 0.19 creates Adam's moments at the first step (ZeRO-1/2, ZeRO-3, BF16_Optimizer alike):
    a joiner restarted at step 0 must still accept the state of a donor that has stepped."""
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import os
    from pathlib import Path

    import ftbridge

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(ftbridge.__file__).parents[1])}
    out = subprocess.run([sys.executable, "-c", _DS_BOUND, str(port)], capture_output=True, text=True, timeout=170,
                         check=False, env=env)
    rows = [line.split()[1:] for line in out.stdout.splitlines() if line.startswith("RESULT")]
    assert len(rows) == 3, out.stdout[-2000:] + out.stderr[-4000:]
    for name, fresh, stepped, bound in rows:
        assert int(fresh) < int(stepped) <= int(bound), (name, fresh, stepped, bound)


# -- slow donor: one overall deadline -------------------------------------------------------------

def _dribble(donor, conn):
    conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 100000\r\n\r\n")
    while not donor.stop.wait(0.5):  # pacing of the attack, not synchronisation
        conn.sendall(b"x")


def _dribble_headers(donor, conn):
    for byte in b"HTTP/1.0 200 OK\r\nX-Slow: " + b"y" * 1000:
        if donor.stop.wait(0.5):
            return
        conn.sendall(bytes([byte]))


@pytest.mark.parametrize("behave", [_dribble, _dribble_headers], ids=["body", "headers"])
def test_a_donor_sending_a_byte_every_half_second_is_cut_off_at_the_deadline(raw_donor, joiner, behave):
    donor = raw_donor(behave)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="heal deadline of 1 s"):
        joiner.recv_checkpoint(0, donor.url, 1, timedelta(seconds=60))  # torchft's timeout is not the bound
    assert time.monotonic() - t0 < 2.0


# -- donor server: idle, slow and non-reading clients -------------------------------------------

@pytest.fixture
def donor():
    t = SafeHTTPTransport("127.0.0.1", timeout=timedelta(seconds=1), heal_timeout=timedelta(seconds=1),
                          max_connections=4, max_recv_bytes=_bound)
    yield t
    t.shutdown()


def _port(t):
    return t._server.server_address[1]


def test_idle_connections_take_at_most_max_connections_threads_and_are_closed(donor):
    threads_before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", _port(donor)), timeout=5) for _ in range(12)]
    try:
        for s in idle:  # every connection gets an answer: closed by the server, unread or at its deadline
            s.settimeout(5)
            assert s.recv(1) == b""
        server = donor._server
        assert server.peak_active <= 4 and server.refused >= 12 - 4
        assert threading.active_count() - threads_before <= 4 + 1  # + the deadline thread
        assert server.wait_idle(5)
    finally:
        for s in idle:
            s.close()
    donor.send_checkpoint([1], 3, {"x": torch.ones(2)}, timedelta(seconds=1))
    assert torch.equal(donor.recv_checkpoint(0, donor.metadata(), 3, timedelta(seconds=5))["x"], torch.ones(2))


def test_an_incomplete_request_is_closed_at_the_request_timeout(donor):
    with socket.create_connection(("127.0.0.1", _port(donor)), timeout=5) as s:
        s.sendall(b"GET /heal/1 HTTP/1.0\r\nX-Slow: a")
        t0 = time.monotonic()
        stop = threading.Event()

        def keep_dribbling():
            while not stop.wait(0.3):
                try:
                    s.sendall(b"a")
                except OSError:
                    return

        th = threading.Thread(target=keep_dribbling, daemon=True)
        th.start()
        try:
            assert s.recv(1) == b""  # EOF: the server closed it
        except ConnectionResetError:
            pass
        finally:
            stop.set()
            th.join(timeout=5)
        assert time.monotonic() - t0 < 2.5


def _request_state(donor, step):
    donor.send_checkpoint([1], step, {"w": torch.zeros(8 << 20)}, timedelta(seconds=1))  # 32 MiB: beyond socket buffers
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
    s.settimeout(5)
    s.connect(("127.0.0.1", _port(donor)))
    s.sendall(b"GET /heal/%d HTTP/1.0\r\n\r\n" % step)
    server = donor._server
    with server._active_cond:  # accepted (peak_active is set at accept and never goes down)
        assert server._active_cond.wait_for(lambda: server.peak_active >= 1, 5)
    return s


def test_a_client_that_never_reads_releases_the_state(donor):
    with _request_state(donor, 5) as s:
        t0 = time.monotonic()
        assert donor._server.wait_idle(5), "the handler still holds the old state"
        assert time.monotonic() - t0 < 3.5
        donor.disallow_checkpoint()
        assert s.recv(16).startswith(b"HTTP/1.0 200")  # it was being served, then cut off


def test_a_client_reading_slowly_is_cut_off_at_the_send_deadline(donor):
    with _request_state(donor, 6) as s:
        stop, got = threading.Event(), [0]

        def read_slowly():  # 1 KiB every 0.1 s: always some progress, so no per-write timeout fires
            while not stop.wait(0.1):
                try:
                    chunk = s.recv(1024)
                except OSError:
                    return
                if not chunk:
                    return
                got[0] += len(chunk)

        reader = threading.Thread(target=read_slowly, daemon=True)
        reader.start()
        t0 = time.monotonic()
        try:
            # The handler (and the state it holds) is released at request timeout (1 s) + send deadline (1 s),
            # while the kernel may still be delivering what it had queued.
            assert donor._server.wait_idle(5), "the handler still holds the old state"
            assert time.monotonic() - t0 < 4.0 and got[0] < 8 << 20
        finally:
            stop.set()
            reader.join(timeout=5)


# -- the heal URL ---------------------------------------------------------------------------------

@pytest.mark.parametrize("url", [
    "file:///etc/passwd#", "file:///tmp/heal/", "https://127.0.0.1:1/heal/", "ftp://127.0.0.1:1/heal/",
    "http://127.0.0.1:1/other/", "http://user:pw@127.0.0.1:1/heal/", "http://127.0.0.1:1/heal/?x=1",
    "http://127.0.0.1/heal/", "http://127.0.0.1:1/heal/ ", "http://127.0.0.1:1\n/heal/",
])
def test_only_http_heal_urls_are_fetched(joiner, url):
    with pytest.raises(ValueError, match="heal URL"):
        joiner.recv_checkpoint(0, url, 1, timedelta(seconds=5))


def test_a_file_url_is_never_read(tmp_path, joiner):
    body = tmp_path / "heal" / "1"
    body.parent.mkdir()
    body.write_bytes(encode_state({"x": torch.ones(2)}))
    with pytest.raises(ValueError, match="heal URL"):
        joiner.recv_checkpoint(0, f"file://{tmp_path}/heal/", 1, timedelta(seconds=5))


def test_a_redirect_is_not_followed(raw_donor, joiner):
    target = raw_donor(_claim(0, b""))
    donor = raw_donor(lambda d, c: c.sendall(
        f"HTTP/1.0 302 Found\r\nLocation: {target.url}1\r\nContent-Length: 0\r\n\r\n".encode()))
    with pytest.raises(urllib.error.HTTPError) as err:
        joiner.recv_checkpoint(0, donor.url, 1, timedelta(seconds=5))
    assert err.value.code == 302 and donor.requests == 1 and target.requests == 0


def test_a_url_on_another_host_than_the_quorums_donor_is_refused_unfetched(raw_donor, joiner):
    donor = raw_donor(_claim(0, b""))
    joiner.expect_donor("http://127.0.0.2:29999")
    with pytest.raises(ValueError, match="not at the donor"):
        joiner.recv_checkpoint(0, donor.url, 1, timedelta(seconds=5))
    assert donor.requests == 0
    joiner.expect_donor("http://127.0.0.1:29999")  # same host, any manager port
    with pytest.raises(ValueError):  # fetched now (an empty body is malformed)
        joiner.recv_checkpoint(0, donor.url, 1, timedelta(seconds=5))
    assert donor.requests == 1


@pytest.mark.parametrize("rank, local, checked", [(0, 2, True), (1, 2, True), (0, 1, True), (1, 1, False),
                                                   (1, 0, True)])
def test_the_manager_checks_the_donor_host_unless_a_spanning_groups_rank_may_sit_elsewhere(rank, local, checked):
    cfg = FTBridgeConfig(group_rank=rank, group_size=2, local_group_size=local)
    seen = []
    fake = SimpleNamespace(cfg=cfg, transport=SimpleNamespace(expect_donor=seen.append))
    ReplicaManager._on_quorum(fake, SimpleNamespace(recover_src_manager_address="http://10.0.0.7:1234"))
    assert seen == ["http://10.0.0.7:1234" if checked else None]


# -- proxies --------------------------------------------------------------------------------------

@pytest.fixture
def proxy(raw_donor, monkeypatch):
    """A 'proxy' that answers 502 to anything; set in every proxy variable of the environment."""
    p = raw_donor(lambda d, c: c.sendall(b"HTTP/1.0 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n"))
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "all_proxy", "grpc_proxy"):
        monkeypatch.setenv(name, f"http://127.0.0.1:{p.port}")
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    return p


def test_heals_ignore_environment_proxies(proxy, donor):
    donor.send_checkpoint([1], 2, {"x": torch.arange(3.0)}, timedelta(seconds=1))
    got = donor.recv_checkpoint(0, donor.metadata(), 2, timedelta(seconds=5))
    assert torch.equal(got["x"], torch.arange(3.0)) and proxy.requests == 0


def test_lighthouse_status_ignores_environment_proxies(proxy, raw_donor):
    from ftbridge.manager.lighthouse_status import StatusFormatError, fetch_status

    lighthouse = raw_donor(lambda d, c: c.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 5\r\n\r\nhello"))
    with pytest.raises(StatusFormatError):  # reached the 'lighthouse' (not a status page), not the proxy
        fetch_status(f"127.0.0.1:{lighthouse.port}", timeout_s=5)
    assert lighthouse.requests == 1 and proxy.requests == 0


def test_lighthouse_status_follows_no_redirect_and_reads_only_http(raw_donor, tmp_path):
    from ftbridge.manager.lighthouse_status import fetch_status

    target = raw_donor(lambda d, c: c.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 5\r\n\r\nhello"))
    lighthouse = raw_donor(lambda d, c: c.sendall(
        f"HTTP/1.0 302 Found\r\nLocation: {target.url}\r\nContent-Length: 0\r\n\r\n".encode()))
    with pytest.raises(urllib.error.HTTPError) as err:
        fetch_status(f"127.0.0.1:{lighthouse.port}", timeout_s=5)
    assert err.value.code == 302 and lighthouse.requests == 1 and target.requests == 0
    (tmp_path / "status").write_text("<div>quorum</div>")
    for address in (f"file://{tmp_path}", "ftp://127.0.0.1:1"):
        with pytest.raises(ValueError, match="only http"):
            fetch_status(address, timeout_s=5)


def test_lighthouse_status_reads_a_bounded_page(raw_donor, monkeypatch):
    from ftbridge.manager import lighthouse_status as status
    from ftbridge.manager.lighthouse_status import StatusFormatError, fetch_status

    monkeypatch.setattr(status, "MAX_STATUS_BYTES", 1000)
    big = raw_donor(lambda d, c: c.sendall(b"HTTP/1.0 200 OK\r\n\r\n" + b"x" * 5000))
    with pytest.raises(StatusFormatError, match="larger than 1000 bytes"):
        fetch_status(f"127.0.0.1:{big.port}", timeout_s=5)


# -- the job token --------------------------------------------------------------------------------

@pytest.fixture
def token_donor():
    t = SafeHTTPTransport("127.0.0.1", timeout=timedelta(seconds=1), token=TOKEN, max_recv_bytes=_bound)
    t.send_checkpoint([1], 4, {"x": torch.ones(3)}, timedelta(seconds=1))
    yield t
    t.shutdown()


@pytest.mark.parametrize("token", [None, "", "wrong-token-of-some-length", TOKEN + "x"])
def test_a_donor_with_a_token_refuses_requests_without_it(token_donor, token):
    j = SafeHTTPTransport("127.0.0.1", timeout=timedelta(seconds=1), token=token, max_recv_bytes=_bound)
    try:
        with pytest.raises(urllib.error.HTTPError) as err:
            j.recv_checkpoint(0, token_donor.metadata(), 4, timedelta(seconds=5))
        assert err.value.code == 403
    finally:
        j.shutdown()


def test_the_right_token_heals_and_never_travels_in_the_clear(token_donor, raw_donor):
    j = SafeHTTPTransport("127.0.0.1", timeout=timedelta(seconds=1), token=TOKEN, max_recv_bytes=_bound)
    try:
        assert torch.equal(j.recv_checkpoint(0, token_donor.metadata(), 4, timedelta(seconds=5))["x"], torch.ones(3))
        spy = raw_donor(_claim(0, b""))
        with pytest.raises(ValueError):
            j.recv_checkpoint(0, spy.url, 4, timedelta(seconds=5))
    finally:
        j.shutdown()
    head = spy.heads[0].decode("latin-1")
    assert TOKEN not in head and "Authorization: FTBridge-HMAC " in head
    # What the spy captured is bound to its own address: replayed at the real donor it is refused.
    mac = head.split("Authorization: ")[1].split("\r\n")[0]
    with socket.create_connection(("127.0.0.1", _port(token_donor)), timeout=5) as s:
        s.sendall(f"GET /heal/4 HTTP/1.0\r\nAuthorization: {mac}\r\n\r\n".encode())
        assert s.makefile("rb").readline().split()[1] == b"403"


def test_without_a_token_on_the_donor_any_request_is_served_as_before(donor):
    donor.send_checkpoint([1], 6, {"x": torch.ones(1)}, timedelta(seconds=1))
    j = SafeHTTPTransport("127.0.0.1", timeout=timedelta(seconds=1), token=TOKEN, max_recv_bytes=_bound)
    try:
        for t in (j, donor):
            assert torch.equal(t.recv_checkpoint(0, donor.metadata(), 6, timedelta(seconds=5))["x"], torch.ones(1))
    finally:
        j.shutdown()


def test_the_job_token_comes_from_the_environment_and_is_never_printed():
    cfg = FTBridgeConfig.resolve(environ={"FTBRIDGE_JOB_TOKEN": TOKEN, "FTBRIDGE_HEAL_TIMEOUT_S": "7.5"})
    assert cfg.job_token == TOKEN and TOKEN not in repr(cfg)
    assert cfg.heal_deadline == timedelta(seconds=7.5)
    assert FTBridgeConfig.resolve(environ={}).heal_deadline == 2 * FTBridgeConfig().cross_replica_timeout
    with pytest.raises(ValueError, match="at least 16"):
        FTBridgeConfig.resolve(environ={"FTBRIDGE_JOB_TOKEN": "short"})
    with pytest.raises(ValueError, match="FTBRIDGE_HEAL_TIMEOUT_S"):
        FTBridgeConfig.resolve(environ={"FTBRIDGE_HEAL_TIMEOUT_S": "0"})


def test_ftbridge_run_sets_the_token_from_a_file_and_hides_it(tmp_path):
    from ftbridge.launch import run as launcher

    path, script = tmp_path / "token", tmp_path / "train.py"
    path.write_text(TOKEN + "\n")
    script.write_text("")
    args = launcher.parse_args(["--replica-group-id", "0", "--num-replica-groups", "2", "--nproc-per-node", "1",
                                "--job-token-file", str(path), "--", str(script)])
    argv, env = launcher.build_torchrun_command(args, {}, pick_port=lambda: 40111, launch_id="t")
    assert env["FTBRIDGE_JOB_TOKEN"] == TOKEN and TOKEN not in " ".join(argv)
    for bad, needle in ((tmp_path / "missing", "not a regular file"), (tmp_path, "not a regular file")):
        with pytest.raises(ValueError, match=needle):
            launcher.read_token_file(str(bad))
    (tmp_path / "short").write_text("abc\n")
    args.job_token_file = str(tmp_path / "short")
    with pytest.raises(ValueError, match="at least 16"):
        launcher.build_torchrun_command(args, {}, pick_port=lambda: 40111, launch_id="t")


def test_mac_compare_is_constant_time_over_bytes():
    mac = limits.request_mac(TOKEN, "http://h:1/heal/", 3)
    assert limits.mac_matches(TOKEN, "http://h:1/heal/", 3, f"FTBridge-HMAC {mac}")
    assert not limits.mac_matches(TOKEN, "http://h:1/heal/", 4, f"FTBridge-HMAC {mac}")
    assert not limits.mac_matches(TOKEN, "http://h:1/heal/", 3, "FTBridge-HMAC \u00e9\u4e00")  # no TypeError
