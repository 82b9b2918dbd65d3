"""Peer watch (ftbridge.manager.quorum_watch): the decisions as pure functions, the wait with a scripted lighthouse."""

from __future__ import annotations

import concurrent.futures
import threading
from datetime import timedelta
from typing import List

import pytest
import torch
from torch.distributed import TCPStore

from ftbridge.config import FTBridgeConfig
from ftbridge.manager.lighthouse_status import Heartbeat, LighthouseStatus, Member
from ftbridge.manager.quorum_watch import (
    FreezeClock,
    PeerLost,
    QuorumWatch,
    WatchedWork,
    dropped_from_quorum,
    lost_members,
    wait_for_keys,
)
from ftbridge.manager.store_probe import ProbedProcessGroupGloo

pytestmark = pytest.mark.timeout(60)  # a watch that never ends a wait fails here, not at the suite's 300 s

ME, PEER, OTHER = "replica_group_0:aaa", "replica_group_1:bbb", "replica_group_2:ccc"
QUORUM = (7, (ME, PEER))


def status(stale=(), fresh=(ME, PEER), quorum_id=7, members=(ME, PEER)) -> LighthouseStatus:
    beats = [Heartbeat(r, 0.05, False) for r in fresh if r not in stale] + [Heartbeat(r, 9.0, True) for r in stale]
    return LighthouseStatus(quorum_id=quorum_id, next_quorum="", heartbeats=beats,
                            members=[Member(m, 1, 1, "", "", False) for m in members])


# -- pure decisions -------------------------------------------------------------
def test_lost_members_names_stale_quorum_members_other_than_this_group():
    assert lost_members([ME, PEER], "replica_group_0", [PEER]) == (PEER,)
    assert lost_members([ME, PEER, OTHER], "replica_group_0", [OTHER, PEER]) == (PEER, OTHER)


def test_lost_members_ignores_own_group_non_members_and_unknown_ids():
    assert lost_members([ME, PEER], "replica_group_0", []) == ()
    # This group's own heartbeat (its rank 0 may be the hung one; another rank of it must not cut itself off).
    assert lost_members([ME, PEER], "replica_group_0", [ME]) == ()
    assert lost_members([ME, PEER], "replica_group_0", [OTHER]) == ()  # stale, but not in this step's quorum
    # A restarted group has a new UUID: the old id being stale says nothing about the member with the new one.
    assert lost_members([ME, "replica_group_1:new"], "replica_group_0", ["replica_group_1:old"]) == ()


def test_dropped_from_quorum_only_for_a_later_quorum_without_this_group():
    assert dropped_from_quorum(7, "replica_group_1", 8, [ME])
    assert not dropped_from_quorum(7, "replica_group_1", 8, [ME, PEER])  # still a member
    assert not dropped_from_quorum(7, "replica_group_1", 7, [ME])        # the same quorum
    assert not dropped_from_quorum(7, "replica_group_1", 2, [ME])        # a restarted lighthouse: not judged


def test_freeze_clock_reports_a_gap_in_its_ticks_only_after_since():
    now = [100.0]
    clock = FreezeClock(timedelta(milliseconds=100), clock=lambda: now[0])
    for _ in range(5):
        now[0] += 0.1
        clock.tick()
    assert clock.frozen_since(0.0) == 0.0
    now[0] += 3.0  # frozen: no tick for 3 s
    clock.tick()
    assert clock.frozen_since(now[0] - 1.0) == pytest.approx(2.9)
    assert clock.frozen_since(now[0] + 1.0) == 0.0  # a step that began after the freeze


# -- the wait, with scripted work and lighthouse ---------------------------------------
class FakeWork:
    """A c10d-like work whose future completes when the test says so."""

    def __init__(self) -> None:
        self.fut: torch.futures.Future = torch.futures.Future()

    def get_future(self) -> torch.futures.Future:
        return self.fut


def scripted_watch(answers: List, on_read=None) -> QuorumWatch:
    """A watch whose lighthouse gives ``answers`` in turn (an Exception is raised), then the last one."""
    reads = []

    def fetch():
        reads.append(1)
        if on_read is not None:
            on_read(len(reads))
        answer = answers[min(len(reads), len(answers)) - 1]
        if isinstance(answer, Exception):
            raise answer
        return answer

    watch = QuorumWatch("http://127.0.0.1:1", "replica_group_0", lambda: QUORUM, poll=timedelta(milliseconds=1),
                        fetch=fetch, freeze=FreezeClock(timedelta(seconds=60)))
    watch.reads = reads
    return watch


def test_wait_returns_when_the_work_completes_and_the_peer_is_alive():
    work = FakeWork()
    watch = scripted_watch([status()], on_read=lambda n: n == 3 and work.fut.set_result(None))
    assert watch.wait(work) == ()
    assert watch.lost == 0 and not watch.take_rebuild()


def test_wait_is_cut_short_once_the_lighthouse_holds_a_member_dead():
    work = FakeWork()
    watch = scripted_watch([status(), status(stale=[PEER])])
    assert watch.wait(work) == (PEER,)
    assert watch.lost == 1
    reads = len(watch.reads)
    assert watch.wait(FakeWork()) == (PEER,)  # the step's other messages: no second wait, no read
    assert len(watch.reads) == reads
    assert watch.take_rebuild() and not watch.take_rebuild()  # the next quorum rebuilds, once


def test_a_look_left_running_by_an_earlier_wait_never_cuts_a_later_one():
    # Chaos seed 50: a look started while a peer of an earlier quorum was stale finished after that wait,
    # and the next wait (another quorum, every member alive) took its verdict and discarded a riding step.
    started, gate, work1, work2 = threading.Event(), threading.Event(), FakeWork(), FakeWork()

    def on_read(n):
        if n == 1:
            started.set()
            gate.wait(10)  # the earlier wait's look hangs until that wait is over
        if n == 3:
            work2.fut.set_result(None)

    watch = scripted_watch([status(stale=[PEER]), status()], on_read=on_read)
    first = concurrent.futures.ThreadPoolExecutor(1).submit(watch.wait, work1)
    assert started.wait(10)
    work1.fut.set_result(None)
    assert first.result(10) == ()
    gate.set()
    watch._pending[1].result(10)  # the earlier look finished, holding PEER dead
    assert watch.wait(work2) == ()
    assert watch.lost == 0 and len(watch.reads) >= 3


def test_wait_keeps_waiting_while_the_lighthouse_does_not_answer():
    work = FakeWork()
    watch = scripted_watch([OSError("refused")], on_read=lambda n: n == 4 and work.fut.set_result(None))
    assert watch.wait(work) == ()
    assert len(watch.reads) == 4 and watch.lost == 0


def test_watched_work_copies_the_result_only_after_a_complete_wait():
    class Managed:
        def __init__(self, ok):
            self._work, self.ok = FakeWork(), ok
            self._work.fut.set_result(None)

        def wait(self):
            return self.ok

    tensor, buf = torch.zeros(3), torch.full((3,), 2.0)
    lost: List = []
    assert WatchedWork(Managed(True), buf, tensor, scripted_watch([status()]), lost.append).wait() is True
    torch.testing.assert_close(tensor, buf)

    tensor = torch.zeros(3)
    abandoned = Managed(True)
    abandoned._work = FakeWork()  # never completes
    assert WatchedWork(abandoned, buf, tensor, scripted_watch([status(stale=[PEER])]), lost.append).wait() is False
    assert torch.count_nonzero(tensor) == 0, "an abandoned result reached the caller's tensor"
    assert len(lost) == 1 and isinstance(lost[0], PeerLost)


def test_vote_wait_ends_early_on_a_dead_member_and_the_quorum_is_remembered():
    server = TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=5))
    watch = scripted_watch([status(stale=[PEER])])
    with pytest.raises(PeerLost):
        wait_for_keys(server, ["vote/1"], timedelta(seconds=30), watch)
    assert watch.wait(FakeWork()) == (PEER,)  # the quorum's all-reduce: cut without a poll
    assert len(watch.reads) == 1


def test_bury_sets_the_group_aside_without_aborting_it():
    class Pending:
        aborted = False

        def abort(self):
            self.aborted = True

    pg = ProbedProcessGroupGloo(timeout=timedelta(seconds=10))
    pending = Pending()
    pg._pg = pending
    pg.bury()
    assert pg._pg is None and not pending.aborted
    pg.abort(errored=False)  # what the next configure does first: nothing left to abort
    assert not pending.aborted


def test_config_peer_watch_settings():
    assert FTBridgeConfig.resolve({}).peer_watch is True
    cfg = FTBridgeConfig.resolve({"FTBRIDGE_PEER_WATCH": "0", "FTBRIDGE_PEER_WATCH_POLL_MS": "50"})
    assert cfg.peer_watch is False and cfg.peer_watch_poll == timedelta(milliseconds=50)
    with pytest.raises(ValueError, match="peer_watch_poll"):
        FTBridgeConfig.resolve({"FTBRIDGE_PEER_WATCH_POLL_MS": "20000"})


def test_allreduce_runs_on_a_private_copy_of_the_callers_tensor():
    class Manager:
        _pg = None

        def allreduce(self, t, reduce_op=None):
            self.sent = t
            return "work"

    manager, tensor = Manager(), torch.ones(4)
    work = scripted_watch([status()]).allreduce(manager, tensor, None)
    # An abandoned gloo operation goes on writing into what it was given: never the caller's (DeepSpeed's) buffer.
    assert manager.sent.data_ptr() != tensor.data_ptr()
    torch.testing.assert_close(manager.sent, tensor)
    assert isinstance(work, WatchedWork)


def test_a_lent_tensor_is_reduced_in_place_without_a_copy():
    class Manager:
        def allreduce(self, t, reduce_op=None):
            self.sent = t
            work = FakeWork()
            work.fut.set_result(None)
            return type("Managed", (), {"_work": work, "wait": lambda self: True})()

    manager, tensor = Manager(), torch.ones(4)
    work = scripted_watch([status()]).allreduce(manager, tensor, None, private=True)
    assert manager.sent is tensor  # a gradient copy the caller made for this message: not copied again
    assert work.wait() is True


def test_the_manager_lends_only_the_tensor_it_was_told_about_and_only_once():
    from types import SimpleNamespace

    from ftbridge.manager.replica import ReplicaManager

    calls: List = []
    watch = SimpleNamespace(allreduce=lambda mgr, t, op, private=False: calls.append((t, private)))
    fake = SimpleNamespace(_lent={}, quorum_watch=watch, _skipped_collective=False,
                           _torchft=SimpleNamespace(errored=lambda: None))
    lent, other = torch.ones(2), torch.ones(2)
    ReplicaManager.lend(fake, lent)
    ReplicaManager.allreduce(fake, other)
    ReplicaManager.allreduce(fake, lent)
    ReplicaManager.allreduce(fake, lent)  # a second all-reduce of the same buffer: copied again
    assert [p for _, p in calls] == [False, True, False]


@pytest.mark.timeout(60)
def test_a_cut_wait_makes_every_member_rebuild_at_the_next_quorum_even_a_steady_one():
    from types import SimpleNamespace

    from tests.test_manager import _members, _run_all

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    guards = _members(store.port, last_ids=[2, 2], qid=2)  # same id and members: torchft would keep the group
    cut = iter([True])
    guards[0][1].watch = SimpleNamespace(take_rebuild=lambda: next(cut, False), poll_s=0.05,
                                         look=lambda remember=False: ())
    _run_all(guards)
    # The process group still holds the abandoned operation: the next all-reduce must not pair with it.
    assert [mgr._quorum_id for mgr, _ in guards] == [-1, -1]
    for mgr, _ in guards:
        mgr._quorum_id = 2
    _run_all(guards)
    assert [mgr._quorum_id for mgr, _ in guards] == [2, 2]  # once only


def test_a_group_frozen_during_the_step_and_dropped_since_discards_it():
    now = [100.0]
    freeze = FreezeClock(timedelta(milliseconds=100), clock=lambda: now[0])
    reads: List[int] = []

    def fetch():
        reads.append(1)
        return status(quorum_id=8, members=(ME,))  # the survivors' quorum, without replica_group_1

    watch = QuorumWatch("http://127.0.0.1:1", "replica_group_1", lambda: QUORUM, fetch=fetch, freeze=freeze)
    errors: List = []
    manager = type("M", (), {"report_error": lambda self, e: errors.append(e)})()
    step_start = now[0]
    now[0] += 0.1
    freeze.tick()
    watch.check_commit(manager, step_start)
    assert errors == [] and reads == []  # not frozen: the lighthouse is not even asked
    now[0] += 5.0  # SIGSTOP, then SIGCONT
    freeze.tick()
    watch.check_commit(manager, step_start)
    assert len(errors) == 1 and "frozen" in str(errors[0])


def test_a_long_freeze_discards_even_before_the_lighthouse_shows_the_group_left_out():
    # The survivors may already have cut this group off and discarded; the lighthouse has not issued the
    # quorum without it yet. Committing the completed all-reduce now would leave the groups with the same
    # step number and different models: only a discard is safe.
    now = [100.0]
    freeze = FreezeClock(timedelta(milliseconds=100), clock=lambda: now[0])
    watch = QuorumWatch("http://127.0.0.1:1", "replica_group_1", lambda: QUORUM,
                        fetch=lambda: status(quorum_id=QUORUM[0], members=QUORUM[1]),  # still the old quorum
                        freeze=freeze, freeze_discard=timedelta(seconds=1))
    errors: List = []
    manager = type("M", (), {"report_error": lambda self, e: errors.append(e)})()
    step_start = now[0]
    now[0] += 0.5  # a short stall: the lighthouse cannot have declared the group dead; it still lists it
    freeze.tick()
    watch.check_commit(manager, step_start)
    assert errors == []
    now[0] += 1.5  # SIGSTOP for 1.5 s, then SIGCONT
    freeze.tick()
    watch.check_commit(manager, step_start)
    assert len(errors) == 1 and "frozen" in str(errors[0])


def test_the_freeze_bound_must_exceed_the_poll():
    from ftbridge.config import FTBridgeConfig

    with pytest.raises(ValueError, match="FTBRIDGE_PEER_WATCH_FREEZE_DISCARD_MS"):
        FTBridgeConfig.resolve(environ={"FTBRIDGE_PEER_WATCH_POLL_MS": "500",
                                        "FTBRIDGE_PEER_WATCH_FREEZE_DISCARD_MS": "400"})
