"""Tests of ftbridge/manager/store_probe.py: calls to a hung TCPStore fail within their deadline instead of blocking."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from ftbridge.manager import store_probe
from ftbridge.manager.store_probe import ProbedProcessGroupGloo, call_bounded, probe_store, rendezvous_wait_s


@pytest.fixture
def hung_store():
    """A TCPStore server in its own process, SIGSTOPped like a hung rank 0; yields its ``host:port``."""
    code = ("import sys; from torch.distributed import TCPStore; "
            "s = TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False); "
            "print(s.port, flush=True); sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        os.kill(proc.pid, signal.SIGSTOP)
        yield f"127.0.0.1:{port}"
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(timeout=10)


def test_call_bounded_returns_the_value_or_reraises():
    assert call_bounded(lambda: 42, timedelta(seconds=5), "x") == 42
    with pytest.raises(KeyError, match="boom"):
        call_bounded(lambda: {}["boom"], timedelta(seconds=5), "x")


@pytest.mark.timeout(60)
def test_probe_of_a_hung_store_times_out_instead_of_blocking(hung_store):
    t = time.monotonic()
    with pytest.raises(TimeoutError, match=f"the quorum's store {hung_store} did not accept a connection within 1 s"):
        probe_store(f"{hung_store}/torchft/3/0", timedelta(seconds=1))
    assert time.monotonic() - t < 5


def test_probe_of_a_live_store_passes():
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    probe_store(f"127.0.0.1:{store.port}/torchft/1/0", timedelta(seconds=5))


@pytest.mark.timeout(60)
def test_configure_on_a_hung_primarys_store_raises_so_torchft_discards_the_step(hung_store):
    # torchft's quorum thread catches configure's exception and records it: the step is discarded on
    # every replica and the next quorum (without the hung group) configures afresh.
    pg = ProbedProcessGroupGloo(timeout=timedelta(seconds=1))
    with pytest.raises(TimeoutError):
        pg.configure(f"{hung_store}/torchft/3/0", "replica_group_0", 0, 2)


@pytest.mark.timeout(60)
def test_configure_on_a_live_store_builds_the_group_on_one_store_connection(monkeypatch):
    import torchft.process_group as torchft_pg

    opened = []

    def counting(real):
        def connect(*args, **kwargs):
            opened.append(args[0])
            return real(*args, **kwargs)
        return connect

    monkeypatch.setattr(store_probe, "create_store_client", counting(store_probe.create_store_client))
    monkeypatch.setattr(torchft_pg, "create_store_client", counting(torchft_pg.create_store_client))
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = ProbedProcessGroupGloo(timeout=timedelta(seconds=5))
    pg.configure(f"127.0.0.1:{store.port}/torchft/1/0", "replica_group_0", 0, 1)
    assert pg.size() == 1
    assert opened == [f"127.0.0.1:{store.port}/torchft/1/0"]  # the probe's connection, reused by the rendezvous
    pg.shutdown()


_RANK_1 = """
import sys
import threading
from datetime import timedelta
from ftbridge.manager.torchft_api import ProcessGroupGloo
pg = ProcessGroupGloo(timeout=timedelta(seconds=30))
pg.configure(sys.argv[1], "replica_group_1", 1, 2)
print("formed", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def gone_peers_address():
    """A prefix of a live store under which rank 1 of 2 published its gloo address, then died (SIGKILL):
    a rendezvous on it finds the address and keeps connecting to a port nobody listens on."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    addr = f"127.0.0.1:{store.port}/torchft/7/0"
    peer = subprocess.Popen([sys.executable, "-c", _RANK_1, addr], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        pg = ProbedProcessGroupGloo(timeout=timedelta(seconds=30))
        pg.configure(addr, "replica_group_0", 0, 2)
        assert peer.stdout.readline().strip() == "formed"
        pg.shutdown()
    finally:
        peer.kill()
        peer.wait(timeout=10)
    yield addr


@pytest.mark.timeout(60)
def test_a_rendezvous_with_a_gone_peer_ends_at_twice_the_timeout_and_installs_nothing_late(gone_peers_address):
    # Gloo alone keeps connecting for up to 5 x its timeout (5 s here, 25 s at the default 5 s); when its
    # retries are refused fast enough it gives up sooner, with its own RuntimeError (retryLimit=3 seen).
    pg = ProbedProcessGroupGloo(timeout=timedelta(seconds=1))
    t = time.monotonic()
    with pytest.raises((TimeoutError, RuntimeError)) as failure:
        pg.configure(gone_peers_address, "replica_group_0", 0, 2)
    assert time.monotonic() - t < 4
    if isinstance(failure.value, TimeoutError):
        assert re.search(r"did not connect within 2 s of entering configure \(2 x cross_replica_timeout\)",
                         str(failure.value))
    else:
        assert "Connection refused" in str(failure.value), failure.value
    for thread in [th for th in threading.enumerate() if th.name == "ftbridge-gloo-rendezvous"]:
        thread.join(timeout=30)  # gloo gives up on its own; its group must not be installed then
        assert not thread.is_alive()
    assert pg._pg is None


def test_the_rendezvous_bound_counts_from_configures_entry_and_a_late_rank_gets_none():
    assert rendezvous_wait_s(entered=100.0, now=100.0, timeout_s=5.0) == 10.0
    assert rendezvous_wait_s(entered=100.0, now=103.0, timeout_s=5.0) == 7.0
    assert rendezvous_wait_s(entered=100.0, now=104.4, timeout_s=5.0) == pytest.approx(5.6)
    assert rendezvous_wait_s(entered=100.0, now=104.5, timeout_s=5.0) is None  # 0.9 x 5 s: peers leave at ~5 s
    assert rendezvous_wait_s(entered=100.0, now=105.01, timeout_s=5.0) is None
    assert rendezvous_wait_s(entered=100.0, now=99.0, timeout_s=5.0) == 10.0  # a clock read before entry


@pytest.mark.timeout(60)
def test_a_rank_that_reaches_the_rendezvous_a_timeout_late_gives_up_at_once_without_trying(monkeypatch):
    # Its peers left the vote with it and wait for its address one timeout: they have gone. Waiting the
    # rendezvous bound for them would delay its group's next quorum by that long.
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    addr = f"127.0.0.1:{store.port}/torchft/5/0"
    tried = []
    monkeypatch.setattr(store_probe.ProcessGroupGloo, "_create_pg", lambda self, *a: tried.append(a))
    real_probe = store_probe.probe_store

    def slow_probe(store_addr, timeout):
        store = real_probe(store_addr, timeout)
        pg._configure_entered -= 5.0  # as if the connection had stalled a whole timeout
        return store

    monkeypatch.setattr(store_probe, "probe_store", slow_probe)
    pg = ProbedProcessGroupGloo(timeout=timedelta(seconds=5))
    t = time.monotonic()
    with pytest.raises(TimeoutError, match=r"reached the rendezvous 5\.\d\d s after entering configure \(opening "
                       r"and probing the store 0\.\d\d s, closing the previous group 0\.\d\d s\)"):
        pg.configure(addr, "replica_group_0", 0, 2)
    assert time.monotonic() - t < 2
    assert tried == []
    monkeypatch.setattr(store_probe, "probe_store", real_probe)
    pg.configure(addr, "replica_group_0", 0, 2)  # on time: the rendezvous is tried
    assert len(tried) == 1



@pytest.mark.timeout(60)
def test_a_stalled_connection_attempt_is_abandoned_for_another(monkeypatch):
    # A stalled attempt is faked in Python (it never reaches c10d): an attempt abandoned inside c10d that ends
    # while the interpreter shuts down aborts it.
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    addr = f"127.0.0.1:{store.port}/torchft/9/0"
    release, calls = threading.Event(), []
    real = store_probe.create_store_client

    def stalls_once(store_addr, timeout):
        calls.append(time.monotonic())
        if len(calls) == 1:
            release.wait(30)
            raise ConnectionError("abandoned attempt")
        return real(store_addr, timeout)

    monkeypatch.setattr(store_probe, "create_store_client", stalls_once)
    try:
        t = time.monotonic()
        client = store_probe.probe_store(addr, timedelta(seconds=5))
        assert len(calls) == 2 and time.monotonic() - t < 4
        client.set("k", "v")
        assert store.get("torchft/9/0/k") == b"v"

        def stalls(store_addr, timeout):
            release.wait(30)
            raise ConnectionError("abandoned attempt")

        monkeypatch.setattr(store_probe, "create_store_client", stalls)
        t = time.monotonic()
        with pytest.raises(TimeoutError, match=r"did not accept a connection within 3 s \(3 attempts"):
            store_probe.connect_store(addr, timedelta(seconds=3))
        assert 2.5 < time.monotonic() - t < 5
    finally:
        release.set()
