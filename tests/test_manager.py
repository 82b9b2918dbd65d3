"""Tests of ftbridge/manager/ (replica.py, quorum_guard.py): the lighthouse-restart guard (pure decisions,
the vote on a real TCPStore) and the timeouts the real torchft Manager ends up with."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
from torch.distributed import TCPStore
from torchft.coordination import LighthouseServer

from ftbridge.config import FTBridgeConfig
from ftbridge.manager import ReplicaManager
from ftbridge.manager.quorum_guard import (
    GroupSizeMismatch,
    QuorumSeen,
    _QuorumGuard,
    decide_reconfigure,
    detect_lighthouse_restart,
    group_size_conflict,
    rendezvous_namespace,
)

A, B, C = "replica_group_0:a", "replica_group_1:b", "replica_group_2:c"


@pytest.mark.parametrize("prev, qid, members, restarted", [
    (None, 1, [A], False),                       # first quorum
    (QuorumSeen(3, (A, B)), 3, [B, A], False),   # same quorum again (order does not matter)
    (QuorumSeen(3, (A, B)), 4, [A], False),      # normal membership change: new id
    (QuorumSeen(3, (A, B)), 1, [A, B], True),    # ids went backwards
    (QuorumSeen(1, (A, B)), 1, [A], True),       # id repeated with other members
    (QuorumSeen(2, (A,)), 2, [A, C], True),
])
def test_detect_lighthouse_restart(prev, qid, members, restarted):
    assert detect_lighthouse_restart(prev, qid, members) is restarted


def test_any_rebuild_vote_rebuilds_everyone_and_a_failed_vote_keeps_the_own_decision():
    assert decide_reconfigure(False, [False, False]) is False
    assert decide_reconfigure(False, [False, True]) is True
    assert decide_reconfigure(True, [True, False]) is True
    assert decide_reconfigure(False, None) is False
    assert decide_reconfigure(True, None) is True


def test_rendezvous_namespace_is_shared_by_members_and_changes_with_step_and_members():
    assert rendezvous_namespace([A, B], 7) == rendezvous_namespace([B, A], 7)
    assert len({rendezvous_namespace([A, B], 7), rendezvous_namespace([A, B], 8), rendezvous_namespace([A], 7)}) == 3


class _FakeClient:
    def __init__(self, result):
        self.result = result

    def _quorum(self, **kwargs):
        return self.result

    def should_commit(self, *args, **kwargs):
        return "delegated"


def _members(store_port, last_ids, qid, step=5, group_sizes=(2, 2)):
    """One guard per member, each with its own torchft-like manager whose last quorum id is given."""
    ids = sorted([A, B])
    guards = []
    for rank, last in enumerate(last_ids):
        result = SimpleNamespace(quorum_id=qid, replica_ids=ids, max_step=step, replica_rank=rank,
                                 replica_world_size=2, store_address=f"127.0.0.1:{store_port}")
        mgr = SimpleNamespace(_client=_FakeClient(result), _quorum_id=last)
        guard = _QuorumGuard(mgr, timedelta(seconds=10), on_restart=lambda old, new: None,
                             group_size=group_sizes[rank])
        guard.seen = QuorumSeen(last, tuple(ids)) if last >= 0 else None
        guards.append((mgr, guard))
    return guards


def _run_all(guards):
    views = [None] * len(guards)

    def run(i):
        try:
            views[i] = guards[i][1]._quorum(group_rank=0, step=5, commit_failures=0)
        except Exception as e:  # noqa: BLE001 (the test inspects it)
            views[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(guards))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return views


@pytest.mark.timeout(60)
def test_a_steady_quorum_skips_the_vote_and_keeps_the_process_group(monkeypatch):
    import ftbridge.manager.quorum_rules as rules

    # Steady by construction, however loaded the machine: a pause between rounds must not count as a stall.
    monkeypatch.setattr(rules, "VOTE_SKIP_WINDOW_S", 600.0)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    guards = _members(store.port, last_ids=[2, 2], qid=2)
    _run_all(guards)  # the first vote in this quorum: group sizes are learnt
    assert [g.votes_skipped for _, g in guards] == [0, 0] and [g.sizes for _, g in guards] == [[2, 2]] * 2
    for _ in range(3):
        views = _run_all(guards)
    assert [g.votes_skipped for _, g in guards] == [3, 3]
    assert [mgr._quorum_id for mgr, _ in guards] == [2, 2]  # kept, as torchft would
    assert views[0].store_address == views[1].store_address


@pytest.mark.timeout(60)
def test_a_member_that_saw_the_lighthouse_stall_votes_even_on_a_quorum_it_voted_in_before(monkeypatch):
    import ftbridge.manager.quorum_rules as rules

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    guards = _members(store.port, last_ids=[2, 2], qid=2)
    _run_all(guards)
    # After a lighthouse restart, A saw quorum 1 = {A} first; B's call spanned the restart (slower than the window).
    guards[0][0]._quorum_id, guards[0][1].seen = 1, QuorumSeen(1, (A,))
    monkeypatch.setattr(rules, "VOTE_SKIP_WINDOW_S", 0.0)
    _run_all(guards)
    assert [g.votes_skipped for _, g in guards] == [0, 0]
    assert [mgr._quorum_id for mgr, _ in guards] == [-1, -1]  # B rebuilds with A: their process groups pair


@pytest.mark.timeout(60)
def test_a_vote_never_reads_a_members_vote_left_from_an_earlier_quorum_with_the_same_keys(monkeypatch):
    """The quorum above again (same id, members and step, as after a lighthouse restart), B voting first: B
    must wait for A's vote of this round, not decide on A's vote of the earlier one (keep) while A rebuilds."""
    import ftbridge.manager.quorum_rules as rules

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    guards = _members(store.port, last_ids=[2, 2], qid=2)
    _run_all(guards)
    guards[0][0]._quorum_id, guards[0][1].seen = 1, QuorumSeen(1, (A,))
    monkeypatch.setattr(rules, "VOTE_SKIP_WINDOW_S", 0.0)
    threads = [threading.Thread(target=_run_all, args=([g],)) for g in reversed(guards)]  # B, then A
    threads[0].start()
    threads[0].join(timeout=2)  # a bound on the failure only: with the fix B waits up to the 10 s vote timeout
    assert threads[0].is_alive(), "B decided before A voted: it read A's vote from the earlier quorum"
    threads[1].start()
    for t in threads:
        t.join(timeout=30)
    assert [mgr._quorum_id for mgr, _ in guards] == [-1, -1]  # B rebuilds with A: their process groups pair


def test_vote_needed_only_a_steady_member_of_a_quorum_it_voted_in_after_a_commit_skips():
    from ftbridge.manager.quorum_rules import VOTE_SKIP_WINDOW_S as W
    from ftbridge.manager.quorum_rules import vote_needed

    steady = dict(own=False, same_as_voted=True, rode=False, call_s=0.01, since_last_s=0.1, commit_failures=0)
    assert not vote_needed(**steady)
    for change in (dict(own=True), dict(same_as_voted=False), dict(rode=True), dict(call_s=W),
                   dict(since_last_s=W), dict(commit_failures=1)):
        assert vote_needed(**{**steady, **change}), change


@pytest.mark.timeout(60)
def test_member_with_the_repeated_id_rebuilds_when_the_other_does():
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    # Before the restart both had quorum 2 = {A, B}; after it, A saw quorum 1 = {A} alone first.
    guards = _members(store.port, last_ids=[1, 2], qid=2)
    guards[0][1].seen = QuorumSeen(1, (A,))
    views = _run_all(guards)
    assert [mgr._quorum_id for mgr, _ in guards] == [-1, -1]  # both reconfigure
    assert guards[1][1].forced == 1 and guards[0][1].forced == 0
    assert views[0].store_address == views[1].store_address
    assert views[0].store_address.startswith(f"127.0.0.1:{store.port}/ftbridge/")
    assert views[0].replica_rank == 0
    assert guards[0][1].should_commit(0, 5, True, timeout=timedelta(seconds=1)) == "delegated"


@pytest.mark.timeout(60)
def test_steady_quorum_rebuilds_nobody():
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    guards = _members(store.port, last_ids=[2, 2], qid=2)
    _run_all(guards)
    assert [mgr._quorum_id for mgr, _ in guards] == [2, 2]


@pytest.mark.timeout(60)
def test_unreachable_store_falls_back_to_torchfts_rule():
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = store.port
    del store
    (mgr, guard), _ = _members(port, last_ids=[2, 2], qid=2)
    guard._timeout = timedelta(seconds=1)
    guard._quorum(group_rank=0)
    assert mgr._quorum_id == 2  # same id, no restart seen: keep the group, as torchft would


def test_torchft_calls_get_twice_the_cross_replica_timeout_even_with_torchfts_env_set(monkeypatch, caplog):
    # torchft's Manager lets TORCHFT_TIMEOUT_SEC override its timeout argument. ftbridge once exported
    # the cross-replica timeout there, silently undoing the 2x: a survivor's should_commit then expired
    # while its other rank waited out an all-reduce with a hung peer, and the group died (chaos soak).
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    for name in ("TORCHFT_QUORUM_TIMEOUT_SEC", "TORCHFT_CONNECT_TIMEOUT_SEC", "TORCHFT_QUORUM_RETRIES"):
        monkeypatch.delenv(name, raising=False)  # the manager sets them: restored after the test
    monkeypatch.setenv("TORCHFT_TIMEOUT_SEC", "3")  # a user's value: replaced, with a warning
    cfg = FTBridgeConfig.resolve({}, lighthouse=lighthouse.address(), cross_replica_timeout=5,
                                 group_rank=0, group_size=1, replica_group_id=0)
    with caplog.at_level(logging.WARNING, logger="ftbridge.manager"):
        manager = ReplicaManager(cfg, state_dict=dict, load_state_dict=lambda state: None,
                             max_heal_bytes=lambda: 64 << 20)
    try:
        assert manager._torchft._timeout == timedelta(seconds=10)
        assert os.environ["TORCHFT_TIMEOUT_SEC"] == "10"
        assert "TORCHFT_TIMEOUT_SEC=3 in the environment is replaced by 10" in caplog.text
    finally:
        manager.shutdown()
        lighthouse.shutdown()


@contextlib.contextmanager
def _rank0_manager(monkeypatch, **settings):
    """A real ReplicaManager of group rank 0 in a 1-group job: its own lighthouse and group TCPStore.

    Yields the manager; ``manager.test_own_ports`` are the lighthouse's and the store's ports (the test's, not
    the manager's listeners).
    """
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    for name in ("TORCHFT_TIMEOUT_SEC", "TORCHFT_QUORUM_TIMEOUT_SEC", "TORCHFT_CONNECT_TIMEOUT_SEC",
                 "TORCHFT_QUORUM_RETRIES"):
        monkeypatch.delenv(name, raising=False)
    cfg = FTBridgeConfig.resolve({}, lighthouse=lighthouse.address(), group_rank=0, group_size=1,
                                 replica_group_id=0, **settings)
    manager = ReplicaManager(cfg, state_dict=dict, load_state_dict=lambda state: None,
                             max_heal_bytes=lambda: 64 << 20)
    manager.test_own_ports = {int(lighthouse.address().rsplit(":", 1)[1]), store.port}
    try:
        yield manager
    finally:
        manager.shutdown()
        lighthouse.shutdown()


def test_torchft_heals_through_ftbridges_pickle_free_transport(monkeypatch):
    # Without checkpoint_transport torchft builds its HTTPTransport (torch.load, weights_only=False) and
    # every heal test still passes: assert on the Manager that ReplicaManager really built.
    from torchft.checkpointing.http_transport import HTTPTransport

    from ftbridge.manager.transport import SafeHTTPTransport

    with _rank0_manager(monkeypatch) as manager:
        used = manager._torchft._checkpoint_transport
        assert type(used) is SafeHTTPTransport and used is manager.transport
        assert not isinstance(used, HTTPTransport)
        # What torchft advertises to a healing peer is this transport's address (GET /heal/STEP).
        assert used.metadata().startswith("http://") and used.metadata().endswith("/heal/")


def _store_process():
    """A TCPStore server in its own process (so it can be SIGSTOPped like a hung rank 0); returns (proc, port)."""
    code = ("import sys; from torch.distributed import TCPStore; "
            "s = TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False); "
            "print(s.port, flush=True); sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline())


def _quorum_within(guard, seconds):
    """Run ``guard._quorum`` in a thread; True if it returned within ``seconds``."""
    t = threading.Thread(target=guard._quorum, kwargs={"group_rank": 0}, daemon=True)
    t.start()
    t.join(timeout=seconds)
    return not t.is_alive()


@pytest.mark.timeout(90)
def test_vote_never_blocks_on_a_hung_primarys_store():
    # The primary's store lives in its group's rank 0. Chaos soak: that rank hung (SIGSTOP) and the
    # vote's clean-up of the previous key (TCPStore.delete_key, which has no timeout) on its store
    # blocked the other groups' quorum threads for the whole hang; their should_commit then expired.
    proc, port = _store_process()
    live = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        guards = _members(port, last_ids=[2, 2], qid=2)
        _run_all(guards)  # a vote on the soon-hung store: this rank's key is left there
        mgr, guard = guards[0]
        guard._timeout = timedelta(seconds=1)
        os.kill(proc.pid, signal.SIGSTOP)
        # Next quorum: the hung group left, the primary (and its store) changed; this rank votes alone.
        mgr._client.result = SimpleNamespace(quorum_id=3, replica_ids=[A], max_step=6, replica_rank=0,
                                             replica_world_size=1, store_address=f"127.0.0.1:{live.port}")
        assert _quorum_within(guard, 10), "the vote blocked on the previous primary's hung store"
        assert mgr._quorum_id == -1  # the new quorum's id differs from 2: every member rebuilds
        # A quorum whose primary is the hung one: the vote times out and falls back, it does not block.
        mgr._quorum_id = 4
        mgr._client.result = SimpleNamespace(quorum_id=4, replica_ids=[A, B], max_step=7, replica_rank=0,
                                             replica_world_size=2, store_address=f"127.0.0.1:{port}")
        assert _quorum_within(guard, 10), "the vote blocked on the hung primary's store"
        assert mgr._quorum_id == 4  # vote failed: torchft's own rule (same id, keep the group)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(timeout=10)


def _listening(pid: int = os.getpid()) -> dict:
    """``{port: address}`` of the TCP sockets process ``pid`` listens on (Linux /proc), address '::' or '0.0.0.0'
    for all interfaces."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = {}
    for table, width in (("tcp", 8), ("tcp6", 32)):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in list(f)[1:]:
                cols = line.split()
                if cols[3] != "0A" or cols[9] not in inodes:   # 0A: LISTEN
                    continue
                hexaddr, hexport = cols[1].split(":")
                raw = bytes.fromhex(hexaddr)
                if width == 8:
                    addr = ".".join(str(b) for b in reversed(raw))
                else:
                    words = [raw[i:i + 4][::-1] for i in range(0, 16, 4)]
                    addr = "::" if not any(raw) else ":".join(w.hex() for w in words)
                out[int(hexport, 16)] = addr
    return out


@pytest.mark.skipif(not os.path.exists("/proc/self/net/tcp"), reason="reads Linux /proc")
def test_a_group_rank_0_listens_where_docs_lighthouse_md_says(monkeypatch):
    # docs/lighthouse.md "Listeners": the heal transport on FTBRIDGE_HEAL_BIND only; torchft 0.2's manager
    # server on every interface (torchft hard-codes bind "[::]:PORT"; no option). If torchft gains one, or the
    # heal transport starts listening everywhere, this fails and the table must change with it.
    before = _listening()
    with _rank0_manager(monkeypatch, heal_bind="127.0.0.1") as manager:
        new = {p: a for p, a in _listening().items() if p not in before and p not in manager.test_own_ports}
        heal_port = int(manager.transport.metadata().split(":")[2].split("/")[0])
        manager_port = int(manager._torchft._manager.address().rsplit(":", 1)[1])
        assert new.get(heal_port) == "127.0.0.1", new
        assert new.get(manager_port) in ("::", "0.0.0.0"), new
        assert set(new) == {heal_port, manager_port}, f"an undocumented listener: {new}"


def test_group_size_conflict_names_both_sizes_and_spares_the_primary():
    assert group_size_conflict([2, 2, 2], 1, 7) is None
    assert group_size_conflict([1, 2], 0, 7) is None                  # the primary goes on
    why = group_size_conflict([1, 2], 1, 7)
    assert "has 2 ranks but the quorum's primary group has 1" in why and "--nproc-per-node" in why
    assert group_size_conflict([1, 0], 1, 7) is None                  # size unknown: not judged
    assert group_size_conflict([], 0, 7) is None                      # the vote failed


@pytest.mark.timeout(60)
def test_a_group_of_another_size_leaves_before_reconfigure_or_heal():
    # Seen: a 2-rank group healed from a 1-rank group, then every rank aborted in gloo (size mismatch),
    # restart after restart. The vote carries the group size; the odd member raises inside the quorum.
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    guards = _members(store.port, last_ids=[1, 1], qid=2, group_sizes=(1, 2))
    views = _run_all(guards)
    assert isinstance(views[1], GroupSizeMismatch) and "has 2 ranks" in str(views[1])
    assert guards[1][0]._quorum_id == 1, "the odd member must not be told to reconfigure"
    assert not isinstance(views[0], Exception) and guards[0][1].sizes == [1, 2]



def test_a_one_rank_group_answers_its_own_commit_vote_and_a_larger_group_asks_its_manager_server():
    class Server:
        def __init__(self):
            self.votes = []

        def should_commit(self, group_rank, step, should_commit, timeout):
            self.votes.append((group_rank, step, should_commit))
            return should_commit

    def guard(group_size):
        server = Server()
        mgr = SimpleNamespace(_client=server, _quorum_id=3)
        return server, _QuorumGuard(mgr, timedelta(seconds=10), on_restart=lambda old, new: None,
                                    group_size=group_size)

    server, one = guard(1)
    assert one.should_commit(0, 7, True, timeout=timedelta(seconds=1)) is True
    assert one.should_commit(0, 7, False, timeout=timedelta(seconds=1)) is False
    assert server.votes == []  # the AND over one rank needs no round trip
    server, two = guard(2)
    assert two.should_commit(1, 7, False, timeout=timedelta(seconds=1)) is False
    assert server.votes == [(1, 7, False)]


def test_a_quorum_call_that_times_out_ends_the_rank_naming_the_setting():
    # torchft raises the builtin TimeoutError; on Python 3.11 that *is* concurrent.futures.TimeoutError, which a
    # poll loop once swallowed (the rank then spun, flooding the lighthouse, and never exited).
    from ftbridge.manager.outage import QuorumTimeout

    class Client:
        def _quorum(self, **kwargs):
            raise TimeoutError("Timeout expired")

    mgr = SimpleNamespace(_client=Client(), _quorum_id=3)
    guard = _QuorumGuard(mgr, timedelta(seconds=10), on_restart=lambda old, new: None)
    guard.quorum_timeout = timedelta(seconds=12)
    with pytest.raises(QuorumTimeout, match=r"quorum timeout \(12 s, FTBRIDGE_QUORUM_TIMEOUT_S\)"):
        guard._quorum(group_rank=0)


def test_a_rank_whose_copy_of_its_rank_0s_answer_was_lost_exits_saying_so():
    from ftbridge.manager.outage import QuorumTimeout, TryNotMade

    class Client:
        def _quorum(self, **kwargs):
            raise TryNotMade("rank 0 of the group decided this step's quorum call first")

    guard = _QuorumGuard(SimpleNamespace(_client=Client(), _quorum_id=3), timedelta(seconds=10),
                         on_restart=lambda old, new: None)
    with pytest.raises(QuorumTimeout, match="copy of the quorum its replica group's rank 0 got this step was lost"):
        guard._quorum(group_rank=1)


# -- a majority of the groups before a lighthouse restart -----------------------------------------

def test_a_quorum_after_a_restart_needs_more_than_half_of_the_groups_before_it():
    from ftbridge.manager.quorum_rules import lacks_majority

    before = ["replica_group_0:a", "replica_group_1:b", "replica_group_2:c"]
    assert lacks_majority(before, ["replica_group_1:b"])                       # one group alone, of three
    assert not lacks_majority(before, ["replica_group_0:a", "replica_group_2:c"])
    assert not lacks_majority(before, ["replica_group_0:x", "replica_group_1:y"])  # restarted groups count
    assert lacks_majority(before[:2], ["replica_group_0:a"])                   # half of two is no majority
    assert not lacks_majority(before[:1], ["replica_group_0:a"])               # alone before, alone after
    # Two quorums that both pass always share a group: they cannot commit apart.
    sides = [["replica_group_0:a", "replica_group_1:b"], ["replica_group_2:c", "replica_group_1:b"]]
    assert all(not lacks_majority(before, s) for s in sides) and set(sides[0]) & set(sides[1])


def test_after_a_restart_the_guard_discards_until_a_majority_is_back_and_stops_past_the_wait(monkeypatch):
    import ftbridge.manager.quorum_guard as manager_module
    from ftbridge.manager.quorum_guard import _QuorumGuard
    from ftbridge.manager.quorum_rules import RestartMajority

    errors = []
    clock = [0.0]
    guard = SimpleNamespace(majority=RestartMajority(30.0), no_majority=0,
                            _manager=SimpleNamespace(report_error=errors.append))
    guard.majority.restarted(("replica_group_0:a", "replica_group_1:b", "replica_group_2:c"), 0.0)
    monkeypatch.setattr(manager_module.time, "monotonic", lambda: clock[0])
    _QuorumGuard._check_majority(guard, 1, ["replica_group_1:b"])   # alone right after the restart
    assert len(errors) == 1 and "not more than half" in str(errors[0]) and guard.majority.pending
    _QuorumGuard._check_majority(guard, 2, ["replica_group_1:b", "replica_group_2:c"])
    assert len(errors) == 1 and guard.majority.pending           # a majority: may commit; nothing committed yet
    _QuorumGuard._check_majority(guard, 3, ["replica_group_1:b"])
    assert len(errors) == 2                                      # alone again before any commit: still discarded
    _QuorumGuard._check_majority(guard, 4, ["replica_group_1:b", "replica_group_2:c"])
    guard.majority.committed()                                   # the group committed there: check done
    _QuorumGuard._check_majority(guard, 5, ["replica_group_1:b"])
    assert len(errors) == 2                                      # no restart pending: torchft's rules only
    guard.majority.restarted(("replica_group_0:a", "replica_group_1:b"), 0.0)
    clock[0] = 31.0                                              # the other never came back within the wait:
    _QuorumGuard._check_majority(guard, 6, ["replica_group_1:b"])  # it may have trained on, cut off; stop
    assert len(errors) == 3 and guard.majority.expired
    _QuorumGuard._check_majority(guard, 7, ["replica_group_0:c", "replica_group_1:b"])
    assert len(errors) == 3 and not guard.majority.expired and guard.majority.pending


def test_the_restart_majority_is_met_only_by_a_commit():
    from ftbridge.manager.quorum_rules import RestartMajority

    m = RestartMajority(5.0)
    m.restarted((), 0.0)
    assert m.pending is None and not m.lacks(["replica_group_0:x"], 1.0)  # no history before: nothing required
    m.restarted(("replica_group_0:a", "replica_group_1:b"), 0.0)
    m.restarted(("replica_group_0:a",), 1.0)                               # the first restart's view stands
    assert m.lacks(["replica_group_0:x"], 4.0) and not m.expired           # 1 of 2 is not more than half
    assert not m.lacks(["replica_group_0:x", "replica_group_1:y"], 4.5)   # they are back: the wait starts again
    assert m.lacks(["replica_group_1:y"], 5.0) and not m.expired
    assert m.lacks(["replica_group_1:y"], 9.5) and m.expired               # past the wait, still lacking
    m.committed()
    assert m.pending is None and not m.expired and not m.lacks(["replica_group_1:y"], 6.0)
    with pytest.raises(ValueError, match="wait_s=-1"):
        RestartMajority(-1)


def test_a_donor_serves_its_heal_state_as_soon_as_the_quorum_names_it():
    # Before torchft rebuilds the cross-replica process group (10-30 ms for gloo), which a joiner with
    # no old group to tear down often skips ahead of: its request used to wait for the donor.
    from ftbridge.config import FTBridgeConfig
    from ftbridge.manager.replica import ReplicaManager

    served = []
    state = {"user": {"default": {"x": torch.ones(2)}}, "torchft": {"step": 7, "batches_committed": 14}}
    fake = SimpleNamespace(cfg=FTBridgeConfig(group_rank=0, group_size=1),
                           transport=SimpleNamespace(expect_donor=lambda a: None,
                                                     send_checkpoint=lambda *a: served.append(a)),
                           _torchft=SimpleNamespace(_manager_state_dict=lambda: state))
    fake._serve_early = lambda joiners, step: ReplicaManager._serve_early(fake, joiners, step)
    quorum = dict(recover_src_manager_address="", replica_ids=["replica_group_0:a", "replica_group_1:b"],
                  heal=False, max_step=7)
    ReplicaManager._on_quorum(fake, SimpleNamespace(**quorum, recover_dst_replica_ranks=[]))
    assert served == []  # not a donor
    ReplicaManager._on_quorum(fake, SimpleNamespace(**quorum, recover_dst_replica_ranks=[1]))
    assert served == [([1], 7, state, fake.cfg.cross_replica_timeout)]


def test_a_failed_early_serve_is_left_to_torchft(caplog):
    from ftbridge.config import FTBridgeConfig
    from ftbridge.manager.replica import ReplicaManager

    def refuse(*a):
        raise TypeError("a leaf that is no tensor")
    fake = SimpleNamespace(cfg=FTBridgeConfig(group_rank=0, group_size=1),
                           transport=SimpleNamespace(send_checkpoint=refuse),
                           _torchft=SimpleNamespace(_manager_state_dict=dict))
    with caplog.at_level(logging.WARNING):
        ReplicaManager._serve_early(fake, [1], 3)
    assert "not served early (TypeError: a leaf that is no tensor)" in caplog.text


def test_a_commit_vote_timeout_ends_the_rank_with_an_error_naming_the_bound_and_the_fix():
    # A rank of the group hung past torchft's should_commit bound (2 x the cross-replica timeout):
    # torchft's client raised a bare "Timeout expired"; the rank must still exit (its vote is cast).
    from ftbridge.config import FTBridgeConfig
    from ftbridge.manager.replica import ReplicaManager

    def hung():
        raise TimeoutError('status: Cancelled, message: "Timeout expired"')
    cfg = FTBridgeConfig(replica_group_id=1, group_rank=0, group_size=2, cross_replica_timeout=timedelta(seconds=4))
    for outage in (None, SimpleNamespace(commit=lambda should_commit: should_commit())):
        fake = SimpleNamespace(cfg=cfg, outage=outage, _torchft=SimpleNamespace(should_commit=hung))
        bound = r"replica group 1 timed out after 8 s .*FTBRIDGE_CROSS_REPLICA_TIMEOUT_S"
        with pytest.raises(RuntimeError, match=bound) as e:
            ReplicaManager.should_commit(fake)
        assert isinstance(e.value.__cause__, TimeoutError)


def test_a_vote_failing_with_an_empty_message_falls_back_instead_of_raising(monkeypatch):
    import ftbridge.manager.quorum_guard as guard_module

    def fail(*a, **k):
        raise RuntimeError("")  # once: IndexError from str(exc).splitlines()[0], and the rank died

    monkeypatch.setattr(guard_module, "call_bounded", fail)
    (mgr, guard), _ = _members(1, last_ids=[2, 2], qid=2)
    guard._quorum(group_rank=0)
    assert mgr._quorum_id == 2


def test_time_the_lighthouse_did_not_answer_gives_the_wait_for_a_majority_again():
    from ftbridge.manager.quorum_rules import RestartMajority

    m = RestartMajority(5.0)
    m.unanswered(1.0)
    assert m.pending is None  # nothing pending: nothing to extend
    before = ("replica_group_0:a", "replica_group_1:b")
    m.restarted(before, 0.0)
    assert m.lacks(["replica_group_0:a"], 4.0) and not m.expired
    m.unanswered(4.5)  # a try went unanswered up to 4.5 s: the others could not come back before
    assert m.lacks(["replica_group_0:a"], 6.0) and not m.expired
    assert m.lacks(["replica_group_0:a"], 9.5) and m.expired


def test_a_quorum_that_would_heal_a_group_back_to_an_earlier_step_is_refused_and_the_step_discarded(monkeypatch):
    """The lighthouse ranks a group by the last request it read of it; a late request of a call the group left
    to ride carries an older step (the simulation found a group heal back over a step it alone had committed)."""
    from ftbridge.manager.quorum_guard import HealBackwards

    errors, seen = [], []
    result = SimpleNamespace(quorum_id=7, replica_ids=sorted([A, B]), max_step=4, replica_rank=0, replica_world_size=2,
                             store_address="127.0.0.1:1", heal=True, recover_src_manager_address="http://b",
                             recover_src_replica_rank=1, max_replica_rank=None, max_world_size=1)
    mgr = SimpleNamespace(_client=_FakeClient(result), _quorum_id=7, current_step=lambda: 5,
                          report_error=errors.append)
    guard = _QuorumGuard(mgr, timedelta(seconds=10), on_restart=lambda old, new: None, on_quorum=seen.append)
    import ftbridge.manager.quorum_rules as rules

    monkeypatch.setattr(rules, "VOTE_SKIP_WINDOW_S", 600.0)  # a steady quorum: no vote on a store
    guard.seen, guard._voted = QuorumSeen(7, tuple(sorted([A, B]))), (7, tuple(sorted([A, B])))
    guard._returned = time.monotonic()
    view = guard._quorum(group_rank=0, step=5, commit_failures=0)
    assert not view.heal and view.recover_src_replica_rank is None and not view.recover_src_manager_address
    assert not seen[0].heal and view.max_step == 4 and guard.refused_heals == 1
    assert len(errors) == 1 and isinstance(errors[0], HealBackwards) and "holds step 5" in str(errors[0])
    mgr.current_step = lambda: 3  # behind the quorum: an ordinary heal goes ahead
    view = guard._quorum(group_rank=0, step=3, commit_failures=0)
    assert view.heal and view.recover_src_replica_rank == 1 and len(errors) == 1
