"""The QUORUM and AGREE drivers (ftbridge.manager.outage): the lighthouse judged by answers, the wait for a
lighthouse call, a group's ranks following rank 0, and riders of one quorum agreeing in threads.

No lighthouse process: a scripted monitor, real HTTP servers that answer or hang on loopback, a dict store,
and riders of one quorum in threads of this process joined by a fake process group whose all-reduce fails
for everyone unless every member of the quorum took part (gloo's behaviour when a peer is missing).
"""

from __future__ import annotations

import http.server
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Dict, List, Optional, Set, Tuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ftbridge.manager.commit import ROW
from ftbridge.manager.lighthouse_monitor import LighthouseMonitor
from ftbridge.manager.outage import POLL, OutageRider, QuorumAnswerLost, QuorumTimeout

pytestmark = pytest.mark.timeout(60)


# -- the lighthouse judged by answers -----------------------------------------------------------------
def _wait_answer(monitor, since, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        answer = monitor.answers(since)
        if answer is not None:
            return answer
        time.sleep(0.01)  # polling a result computed in the monitor's own thread
    raise AssertionError("the monitor gave no answer")


def test_a_hung_lighthouse_that_accepts_connections_does_not_answer():
    with socket.socket() as s:  # accepts (the kernel's backlog) but never reads or answers: SIGSTOP, a proxy
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        port = s.getsockname()[1]
        m = LighthouseMonitor(f"http://127.0.0.1:{port}", deadline=timedelta(milliseconds=100))
        t0 = time.monotonic()
        assert _wait_answer(m, t0) is False
        assert time.monotonic() - t0 < 1.0
    closed = LighthouseMonitor(f"http://127.0.0.1:{port}", deadline=timedelta(milliseconds=100))
    assert _wait_answer(closed, time.monotonic()) is False


def test_a_lighthouse_that_answers_its_status_page_answers_and_anything_else_does_not():
    calls = []

    def probe(address, timeout_s):
        calls.append(address)
        if "bad" in address:
            raise OSError("502 Bad Gateway")

    good = LighthouseMonitor("http://good", deadline=timedelta(seconds=1), probe=probe)
    assert _wait_answer(good, time.monotonic()) is True
    bad = LighthouseMonitor("http://bad", deadline=timedelta(seconds=1), probe=probe)
    assert _wait_answer(bad, time.monotonic()) is False


def test_a_real_http_server_that_is_not_a_lighthouse_does_not_count():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"<html>a load balancer's page</html>")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        m = LighthouseMonitor(f"http://127.0.0.1:{server.server_port}", deadline=timedelta(seconds=1))
        assert _wait_answer(m, time.monotonic()) is False
    finally:
        server.shutdown()


def test_only_a_probe_started_since_counts_one_runs_at_a_time_and_a_late_answer_counts():
    release = threading.Event()

    def probe(address, timeout_s):
        release.wait(5)

    clock = [100.0]
    m = LighthouseMonitor("http://lh", deadline=timedelta(seconds=1), probe=probe, clock=lambda: clock[0])
    assert m.answers(since=100.0) is None and m.probes == 1
    assert m.answers(since=100.0) is None and m.probes == 1  # one in flight: no second probe
    clock[0] = 101.5
    assert m.answers(since=100.0) is None   # past its deadline: its own timeout ends it, or its answer comes
    clock[0] = 102.0
    assert m.answers(since=100.0) is False  # still in flight at twice its deadline
    release.set()
    deadline = time.monotonic() + 5
    while m._inflight is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert m.answers(since=100.0) is True   # it answered late (this process paused): the lighthouse is up
    assert m.answers(since=101.0) is None and m.probes == 2  # older than ``since``: a new probe


# -- the wait for one lighthouse call ---------------------------------------------------------------
class Store:
    """A dict store with TCPStore's calls the drivers use."""

    def __init__(self):
        self.kv: Dict[str, bytes] = {}
        self.cond = threading.Condition()

    def set(self, k, v):
        with self.cond:
            self.kv[k] = v if isinstance(v, bytes) else str(v).encode()
            self.cond.notify_all()

    def delete_key(self, k):
        with self.cond:
            self.kv.pop(k, None)

    def add(self, k, n):
        with self.cond:
            value = int(self.kv.get(k, b"0")) + n
            self.kv[k] = str(value).encode()
            self.cond.notify_all()
            return value

    def check(self, keys):
        with self.cond:
            return all(k in self.kv for k in keys)

    def wait(self, keys, timeout):
        with self.cond:
            if not self.cond.wait_for(lambda: all(k in self.kv for k in keys), timeout=timeout.total_seconds()):
                raise TimeoutError(f"keys {keys} not set")

    def get(self, k):
        with self.cond:
            return self.kv[k]


class ScriptedMonitor:
    def __init__(self, answer: Optional[bool]):
        self.answer = answer

    def answers(self, since):
        return self.answer


class PG:
    def errored(self):
        return None


class Torchft:
    """What the drivers read of torchft's Manager."""

    def __init__(self, step: int = 10, store=None) -> None:
        self._quorum_id = 1
        self._pg = PG()
        self._store = store
        self.step = step
        self.error: Optional[Exception] = None
        self.participants, self.participating = 2, True

    def errored(self):
        return self.error

    def report_error(self, e):
        self.error = self.error or e

    def current_step(self):
        return self.step

    def num_participants(self):
        return self.participants

    def is_participating(self):
        return self.participating


@dataclass
class Quorum:
    quorum_id: int
    replica_rank: int
    replica_world_size: int
    store_address: str = "store"


def _rider(answer=None, rank=0, size=1, store=None, committed=True, **kw) -> OutageRider:
    r = OutageRider(Torchft(store=store), enabled=True, lighthouse="lh", group_rank=rank, group_size=size,
                    decision_timeout=timedelta(seconds=5), monitor=ScriptedMonitor(answer), **kw)
    r.remember(Quorum(1, 0, 2), ["replica_group_0:a", "replica_group_1:b"])
    r.after_commit(committed, False)
    return r


def test_a_call_that_times_out_is_raised_at_once_not_polled_forever():
    """torchft raises the builtin TimeoutError when a quorum call times out; on Python >= 3.11 that is
    concurrent.futures.TimeoutError too. A poll loop that caught it as its own poll timeout spun at a full core
    and never returned (the min-replicas wedge)."""
    r = _rider(answer=True)

    def call(timeout):
        raise TimeoutError("Timeout expired")

    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="Timeout expired"):
        r.quorum(call)
    assert time.monotonic() - t0 < 1.0 and not r.riding


class Tries:
    """A lighthouse call whose first ``fail`` tries end by torchft's deadline; records each try's timeout and
    how many were in flight at once. ``made``: an event this call sets when its answering try is made;
    ``round_made``: an event its answering try waits for (the other rank's try of the same round)."""

    def __init__(self, fail: int, answer=None, round_made=None, made=None) -> None:
        self.fail, self.answer, self.round_made, self.made = fail, answer, round_made, made
        self.timeouts: List[timedelta] = []
        self.lock, self.inflight, self.most = threading.Lock(), 0, 0

    def __call__(self, timeout):
        with self.lock:
            self.timeouts.append(timeout)
            self.inflight += 1
            self.most = max(self.most, self.inflight)
            n = len(self.timeouts)
        try:
            if n <= self.fail:
                raise TimeoutError("Timeout expired")
            if self.made is not None:  # this answering try is made: the other rank's may be answered
                self.made.set()
            if self.round_made is not None and not self.round_made.wait(timeout.total_seconds()):
                raise TimeoutError("Timeout expired")
            return self.answer
        finally:
            with self.lock:
                self.inflight -= 1


def test_a_call_is_made_in_tries_one_at_a_time_within_the_quorum_timeout():
    """ftbridge makes the tries torchft's manager server used to retry itself: a request torchft retried could
    not be taken back and reached a restarted lighthouse with an old step."""
    r = _rider(answer=True, quorum_timeout=timedelta(seconds=3), tries=3)
    call = Tries(fail=2, answer=Quorum(2, 0, 2))
    assert r.quorum(call).quorum_id == 2 and not r.riding
    assert call.timeouts == [timedelta(seconds=1)] * 3 and call.most == 1
    r.after_commit(True, False)
    spent = Tries(fail=3)
    with pytest.raises(TimeoutError, match="Timeout expired"):
        r.quorum(spent)
    assert len(spent.timeouts) == 3


def ask_as_a_group_of_two(r0, r1, fail: int, quorum_id: int):
    """Ranks 0 (in a thread) and 1 of one group ask for a quorum whose first ``fail`` tries end by torchft's deadline
    and whose next try is answered with ``quorum_id`` once both ranks made it; returns both calls (:class:`Tries`)."""
    made = threading.Event()  # torchft's manager server answers a round once every rank made its try
    c1 = Tries(fail=fail, answer=Quorum(quorum_id, 1, 2), made=made)
    c0 = Tries(fail=fail, answer=Quorum(quorum_id, 0, 2), round_made=made)
    t = threading.Thread(target=r0.quorum, args=(c0,))
    t.start()
    assert r1.quorum(c1).quorum_id == quorum_id
    t.join(10)
    return c0, c1


def test_a_rank_other_than_0_makes_its_tries_again_while_it_follows():
    """torchft's manager server sends a try to the lighthouse once every rank of the group made it: a rank that
    stopped after its first try would leave rank 0's later tries unanswered."""
    store = Store()
    kw = dict(answer=True, size=2, store=store, quorum_timeout=timedelta(seconds=3), tries=3)
    r0, r1 = _rider(rank=0, **kw), _rider(rank=1, **kw)
    c0, c1 = ask_as_a_group_of_two(r0, r1, fail=2, quorum_id=2)
    assert len(c0.timeouts) == len(c1.timeouts) == 3


class StopsAnswering:
    """A lighthouse that answers the probe at a step's start and none after it."""

    def __init__(self) -> None:
        self.asked = False

    def answers(self, since):
        first, self.asked = not self.asked, True
        return first


def test_a_call_left_to_ride_is_held_then_taken_up_never_doubled():
    """While a call the group left is in flight its row holds every member on the ride; a step that must ask
    meanwhile waits on that call instead of making a second one (two requests of one group in torchft's manager
    server: the answer to one goes to the other's caller)."""
    r = _rider(answer=True)
    r._monitor = StopsAnswering()
    hung, calls = threading.Event(), []

    def call(timeout):
        calls.append(timeout)
        hung.wait(30)
        return Quorum(3, 0, 2)

    r.quorum(call)
    assert r.riding and r.holding()
    r.after_commit(False, False)  # the riding step failed: the next one must ask
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("q", r.quorum(call)))
    t.start()
    deadline = time.monotonic() + 10
    while r._adopted is None and time.monotonic() < deadline:  # the step took the left call up
        time.sleep(0.01)
    hung.set()
    t.join(10)
    assert out["q"].quorum_id == 3 and len(calls) == 1 and not r.holding()
    assert r.history.dead_ends() == ()  # the answer taken up is this step's quorum, not a dead end


@dataclass
class Answer:
    """A lighthouse answer with the fields the stale-answer rule reads."""

    quorum_id: int
    max_world_size: int
    replica_ids: Tuple[str, ...] = ("replica_group_0:a", "replica_group_1:b")
    heal: bool = False
    replica_rank: int = 0
    replica_world_size: int = 2


def test_the_first_answer_after_a_clean_ride_that_counts_a_ridden_member_behind_is_asked_again():
    """Seen with real processes after a hung lighthouse continued: it issued a quorum from the fresh request of
    one group and a request the other group's earlier try had left there, whose owner no longer waited for it.
    The first group acted on it alone and waited out the cross-replica timeout (12.7 s)."""
    r = _rider(answer=True, quorum_timeout=timedelta(seconds=3), tries=3)
    r.riding = True
    r.after_commit(True, False)  # a riding step committed; the agreement ended the ride
    answers = iter([Answer(4, max_world_size=1), Answer(4, max_world_size=2)])
    calls = []

    def call(timeout):
        calls.append(timeout)
        return next(answers)

    assert r.quorum(call).max_world_size == 2 and len(calls) == 2
    r.riding = True
    r.after_commit(False, False)  # a riding step failed: a member behind may be real
    assert r.quorum(lambda timeout: Answer(5, max_world_size=1)).quorum_id == 5
    r.after_commit(True, False)  # not riding before: the answer stands
    assert r.quorum(lambda timeout: Answer(6, max_world_size=1)).quorum_id == 6


def test_a_call_to_a_lighthouse_that_does_not_answer_is_left_for_a_ride():
    r = _rider(answer=False)
    hung = threading.Event()
    t0 = time.monotonic()
    result = r.quorum(lambda timeout: hung.wait(30))
    assert r.riding and result.quorum_id == 1 and result.max_step == 10 and not result.heal
    assert time.monotonic() - t0 < 10 * POLL.total_seconds()
    hung.set()


def test_a_call_outliving_its_deadline_fails_when_riding_is_not_possible():
    r = _rider(answer=False, committed=False, quorum_deadline=timedelta(milliseconds=200))
    hung = threading.Event()
    with pytest.raises(QuorumTimeout, match="did not end within 0.2 s"):
        r.quorum(lambda timeout: hung.wait(30))
    hung.set()


def test_a_rank_follows_its_rank_0_even_when_its_own_call_answered():
    """Rank 0 left a call in flight and rode while rank 1's call returned: rank 1 must ride too, or the
    group's ranks act on different quorums (one heals, the other does not)."""
    store = Store()
    r0, r1 = _rider(answer=False, rank=0, size=2, store=store), _rider(answer=True, rank=1, size=2, store=store)
    hung = threading.Event()
    out = {}
    t = threading.Thread(target=lambda: out.setdefault(0, r0.quorum(lambda timeout: hung.wait(30))))
    t.start()
    out[1] = r1.quorum(lambda timeout: Quorum(2, 0, 2))  # the answer rank 0 left
    t.join(10)
    assert r0.riding and r1.riding and out[1].quorum_id == out[0].quorum_id == 1
    hung.set()


def test_a_rank_follows_its_rank_0s_answer_and_its_failure():
    store = Store()
    r0, r1 = _rider(answer=True, rank=0, size=2, store=store), _rider(answer=True, rank=1, size=2, store=store)
    threading.Thread(target=lambda: r0.quorum(lambda timeout: Quorum(2, 0, 2))).start()
    assert r1.quorum(lambda timeout: Quorum(2, 1, 2)).quorum_id == 2 and not r1.riding

    def fail(timeout):
        raise TimeoutError("Timeout expired")

    r0.after_commit(True, False), r1.after_commit(True, False)
    threading.Thread(target=lambda: pytest.raises(TimeoutError, r0.quorum, fail)).start()
    with pytest.raises(QuorumTimeout, match="rank 0's lighthouse call failed"):
        r1.quorum(lambda timeout: Quorum(2, 1, 2))


def _rank_0_answers_first(store, answer=None, **kw):
    """Group rank 0 of a 2-rank group, answered at once (by default the quorum it holds again); returns once it
    published its outcome."""
    r0 = _rider(answer=True, rank=0, size=2, store=store, **kw)
    r0.quorum(lambda timeout: answer or Answer(1, 2))
    return r0


def test_a_rank_whose_copy_of_rank_0s_answer_was_lost_discards_the_step_on_the_last_quorum():
    """Seen with real processes: a rank frozen longer than one try with its try in flight. Rank 0 got the
    round's answer; this rank's deadline had passed when it woke, and it exited (its group restarted)."""
    store = Store()
    _rank_0_answers_first(store)
    r1 = _rider(answer=True, rank=1, size=2, store=store)

    def lost(timeout):
        raise TimeoutError("Timeout expired")

    result = r1.quorum(lost)
    assert result.quorum_id == 1 and r1.lost and not r1.riding and r1.lost_answers == 1
    assert isinstance(r1._manager.errored(), QuorumAnswerLost)  # the group's decision discards the step


@pytest.mark.parametrize("answer", [Answer(2, 2), Answer(1, 1, ("replica_group_0:a",))], ids=["new-id", "members"])
def test_a_lost_copy_of_another_quorum_ends_the_rank(answer):
    """Rank 0 took up a quorum this rank never saw: this rank's quorum history would miss it, and the
    continuity rule would stop the group for a gap nobody trained in (found by the simulation)."""
    store = Store()
    _rank_0_answers_first(store, answer=answer)
    r1 = _rider(answer=True, rank=1, size=2, store=store)

    def lost(timeout):
        raise TimeoutError("Timeout expired")

    with pytest.raises(QuorumTimeout, match="not the quorum this rank holds"):
        r1.quorum(lost)
    assert not r1.lost


def test_a_lost_answer_after_a_second_try_still_ends_the_rank():
    """A second try of this rank may wait at torchft's manager server for a round rank 0 never joins: the
    rounds could pair wrongly from then on, so only the restart of the group clears it."""
    store = Store()
    _rank_0_answers_first(store, quorum_timeout=timedelta(seconds=3), tries=3)
    r1 = _rider(answer=True, rank=1, size=2, store=store, quorum_timeout=timedelta(seconds=3), tries=3)
    made = []

    def lost(timeout):
        made.append(timeout)
        r1._made += 1  # as if an earlier try of this call had reached the server too
        raise TimeoutError("Timeout expired")

    with pytest.raises(TimeoutError):
        r1.quorum(lost)
    assert not r1.lost and len(made) == 1  # rank 0 had decided: no try made again


def test_a_rank_makes_no_try_again_once_its_rank_0_decided():
    """A try made after rank 0's outcome would wait at torchft's manager server in a round rank 0 never
    joins, and pair the group's next rounds wrongly."""
    store = Store()
    kw = dict(quorum_timeout=timedelta(seconds=3), tries=3)
    r0 = _rider(answer=True, rank=0, size=2, store=store, **kw)
    r1 = _rider(answer=True, rank=1, size=2, store=store, **kw)
    tried = threading.Event()
    t = threading.Thread(target=r0.quorum, args=(lambda timeout: tried.wait(10) and Answer(1, 2),))
    t.start()
    made = []

    def lost(timeout):  # rank 0's answer comes within this rank's retry grace
        made.append(timeout)
        tried.set()
        raise TimeoutError("Timeout expired")

    assert r1.quorum(lost).quorum_id == 1 and r1.lost and len(made) == 1
    t.join(10)


class ManagerServer:
    """torchft 0.2's ``ManagerServer.quorum`` (src/manager.rs) for one replica group of ``world_size`` ranks: a request
    enters its group rank into the round's participants and subscribes to the one broadcast channel; the request that
    completes the participants clears them and starts the lighthouse call with *its own* timeout; the answer goes to
    every request subscribed when it is sent. A request whose caller timed out leaves its entry behind.

    ``lighthouse(round, timeout_s)`` returns the quorum id of a round, or ``None`` (no broadcast, as torchft's error
    path)."""

    def __init__(self, world_size: int, lighthouse) -> None:
        self.world_size, self.lighthouse = world_size, lighthouse
        self.lock = threading.Lock()
        self.participants: Set[int] = set()
        self.subscribed: List[dict] = []
        self.rounds = 0
        self.requests: Dict[int, int] = {}

    def quorum(self, group_rank: int, timeout: timedelta):
        box = {"done": threading.Event(), "answer": None}
        with self.lock:
            self.requests[group_rank] = self.requests.get(group_rank, 0) + 1
            self.participants.add(group_rank)
            self.subscribed.append(box)
            if len(self.participants) == self.world_size:
                self.participants.clear()
                self.rounds += 1
                threading.Thread(target=self._round, args=(self.rounds, timeout.total_seconds()), daemon=True).start()
        if not box["done"].wait(timeout.total_seconds()):
            with self.lock:
                if not box["done"].is_set():
                    self.subscribed.remove(box)
                    raise TimeoutError("Timeout expired")
        return Answer(box["answer"], 2, replica_rank=group_rank)

    def _round(self, n: int, timeout_s: float) -> None:
        qid = self.lighthouse(n, timeout_s)
        if qid is None:
            return
        with self.lock:
            boxes, self.subscribed = self.subscribed, []
        for box in boxes:
            box["answer"] = qid
            box["done"].set()


def test_a_following_rank_tries_after_its_rank_0_so_it_gets_the_answer_rank_0_gets():
    """Seen in the chaos soak (seeds 75, 76): while the lighthouse hung, rank 0 read its status before each retry
    (up to a read timeout each) and rank 1 did not, so rank 1's retry reached torchft's manager server first and its
    deadline passed first. The lighthouse answered the round between the two deadlines: rank 0 got the quorum,
    rank 1's copy was lost, and rank 1 exited (a new quorum) or left a request behind for the next round."""
    store = Store()
    kw = dict(size=2, store=store, quorum_timeout=timedelta(seconds=3), tries=3)
    r0, r1 = _rider(answer=True, rank=0, **kw), _rider(answer=True, rank=1, **kw)
    never = threading.Event()

    def lighthouse(n: int, timeout_s: float):
        if n == 1:  # hung: the round ends by its deadline without a broadcast
            never.wait(timeout_s)
            return None
        never.wait(0.5)  # answers half a try after the round began
        return 2

    server = ManagerServer(2, lighthouse)

    def slow_status(address, timeout_s):  # the hung lighthouse's status page: each read waits out its timeout
        never.wait(0.4)
        raise OSError("timed out")

    r0.unseen._me, r0.unseen._me_of, r0.unseen._fetch = "replica_group_0:a", None, slow_status
    got = {}
    t = threading.Thread(target=lambda: got.update(r0=r0.quorum(lambda timeout: server.quorum(0, timeout))))
    t.start()
    got["r1"] = r1.quorum(lambda timeout: server.quorum(1, timeout))
    t.join(10)
    assert got["r0"].quorum_id == got["r1"].quorum_id == 2 and not r1.lost
    assert server.participants == set() and server.requests == {0: 2, 1: 2}  # no request left for the next round


def test_a_rank_whose_rank_0_is_gone_stops_with_a_deadline():
    r1 = _rider(rank=1, size=2, store=Store(), quorum_deadline=timedelta(milliseconds=100))
    r1._decision_timeout = timedelta(milliseconds=100)
    with pytest.raises(QuorumTimeout, match="could not share this step's quorum decision"):
        r1.quorum(lambda timeout: Quorum(2, 1, 2))


# -- riders of one quorum, in threads ---------------------------------------------------------------
class Phase:
    """One collective of one step: every group in it calls ``allreduce`` or ``absent`` exactly once."""

    def __init__(self, parties: int, world: int) -> None:
        self.barrier = threading.Barrier(max(parties, 1), timeout=30)
        self.slots: Dict[int, torch.Tensor] = {}
        self.world = world
        self.called: Set[int] = set()

    def allreduce(self, rank: int, t: torch.Tensor) -> None:
        self.called.add(rank)
        self.slots[rank] = t.clone()
        self.barrier.wait()
        if sorted(self.slots) != list(range(self.world)):
            raise RuntimeError(f"gloo: members {sorted(set(range(self.world)) - set(self.slots))} missing")
        t.copy_(sum(self.slots.values()))

    def absent(self, rank: int) -> None:
        if rank not in self.called:
            self.barrier.wait()


class Work:
    def wait(self, timeout=None):
        return True


class SimPG(PG):
    def __init__(self) -> None:
        self.phase: Optional[Phase] = None
        self.rank = 0
        self.sizes: List[int] = []
        """Sizes of the all-reduces issued, in order: gloo pairs the n-th of every member, and aborts on a mismatch."""

    def allreduce(self, tensors, opts):
        self.sizes.append(tensors[0].numel())
        self.phase.allreduce(self.rank, tensors[0])
        return Work()


@dataclass
class StepPlan:
    lighthouse_up: bool
    probe_lies: Set[int]
    dies: Set[int]
    error_before_sync: Set[int]
    error_after_sync: Set[int]
    asks: Set[int] = field(default_factory=set)
    """Groups that do not ride this step and get the same quorum from the lighthouse (it answers them only)."""


def _riders(n: int, steps: List[int]):
    ids = [f"replica_group_{i}:uuid{i}" for i in range(n)]
    riders, tfs, monitors = [], [], []
    for i in range(n):
        tf = Torchft(steps[i])
        tf._pg = SimPG()
        tf._pg.rank = i
        tf.participants = n
        monitor = ScriptedMonitor(None)
        r = OutageRider(tf, enabled=True, lighthouse=f"lh{i}", group_rank=0, group_size=1,
                        decision_timeout=timedelta(seconds=5), monitor=monitor, replica_group_id=i)
        r.remember(Quorum(1, i, n), ids)
        r.after_commit(True, False)
        riders.append(r)
        tfs.append(tf)
        monitors.append(monitor)
    return riders, tfs, monitors


def _run_step(plan: StepPlan, riders, tfs, monitors, alive: Set[int]) -> Dict[int, bool]:
    """One step of every live group; returns {group: committed} for the groups that rode it or asked the lighthouse
    (:attr:`StepPlan.asks`). A group of one rank: its decision is its own agreement and error."""
    n = len(riders)
    alive -= plan.dies
    riding = []
    for i in sorted(alive):
        monitors[i].answer = plan.lighthouse_up != (i in plan.probe_lies)
        tfs[i].error = None
        tfs[i]._pg.sizes = []
        if riders[i].reuse() is not None:
            riding.append(i)
        elif i in plan.asks:
            riders[i].remember(Quorum(1, i, n), [f"replica_group_{k}:uuid{k}" for k in range(n)])
            riding.append(i)
    grad, agree = Phase(len(riding), n), Phase(len(riding), n)
    out: Dict[int, bool] = {}

    def one(i: int) -> None:
        tf = tfs[i]
        tf._pg.phase = grad
        if i in plan.error_before_sync:
            tf.report_error(RuntimeError("local"))
            grad.absent(i)  # torchft's allreduce is a no-op after an error
        else:
            try:
                grad.allreduce(i, torch.ones(2))
            except RuntimeError as e:
                tf.report_error(e)
        if i in plan.error_after_sync:
            tf.report_error(RuntimeError("guard"))
        tf._pg.phase = agree
        verdict = riders[i].agree()
        agree.absent(i)
        committed = tf.error is None
        tf.step += committed
        riders[i].after_commit(committed, committed and verdict.ride_on)
        out[i] = committed

    threads = [threading.Thread(target=one, args=(i,)) for i in riding]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    for i in sorted(alive - set(riding)):
        riders[i].after_commit(False, False)  # waits for the lighthouse: this sketch never brings it back
    return out


def test_all_groups_ride_a_clean_outage_and_leave_it_together():
    riders, tfs, monitors = _riders(3, [10, 10, 10])
    alive = {0, 1, 2}
    down = StepPlan(False, set(), set(), set(), set())
    for _ in range(5):
        assert _run_step(down, riders, tfs, monitors, alive) == {0: True, 1: True, 2: True}
    assert [tf.step for tf in tfs] == [15, 15, 15]
    # The lighthouse answers group 1's probe only: that step still rides (decided by the last agreement),
    # and every group leaves at the next one.
    assert _run_step(StepPlan(False, {1}, set(), set(), set()), riders, tfs, monitors, alive) == {0: True, 1: True,
                                                                                                     2: True}
    assert _run_step(down, riders, tfs, monitors, alive) == {}
    assert [r.rides for r in riders] == [6, 6, 6] and [r.ride_commits for r in riders] == [6, 6, 6]


def test_a_group_that_asked_the_lighthouse_runs_the_riders_collectives_and_commits_with_them():
    """Entry into riding is per group. A group that reached the lighthouse and got the same quorum must issue
    the very collectives the riders issue in that step: gloo pairs the n-th all-reduce of every member and
    aborts the process on a size mismatch."""
    riders, tfs, monitors = _riders(3, [10, 10, 10])
    plan = StepPlan(False, {1}, set(), set(), set(), asks={1})
    assert _run_step(plan, riders, tfs, monitors, {0, 1, 2}) == {0: True, 1: True, 2: True}
    assert [r.riding for r in riders] == [True, False, True]
    assert tfs[0]._pg.sizes == tfs[1]._pg.sizes == tfs[2]._pg.sizes == [3 * ROW]  # the gradients: Phase, not SimPG
    assert [tf.step for tf in tfs] == [11, 11, 11]


def test_after_going_back_a_probe_from_the_outage_does_not_send_the_group_riding_again():
    riders, tfs, monitors = _riders(2, [10, 10])
    alive = {0, 1}
    for _ in range(2):
        assert _run_step(StepPlan(False, set(), set(), set(), set()), riders, tfs, monitors, alive) == {0: True,
                                                                                                         1: True}
    assert _run_step(StepPlan(False, {1}, set(), set(), set()), riders, tfs, monitors, alive) == {0: True, 1: True}
    # Group 0's last probe started during the outage and failed; group 1 heard the lighthouse, so both go
    # back and commit on its quorum.
    probe_started = time.monotonic()

    class Stale:
        def answers(self, since):
            return False if since <= probe_started else None  # only that old probe has finished

    riders[0]._monitor = Stale()
    both = StepPlan(False, set(), set(), set(), set(), asks={0, 1})
    assert _run_step(both, riders, tfs, monitors, alive) == {0: True, 1: True}
    assert riders[0].reuse() is None  # asks the lighthouse instead of riding alone on the stale probe


def test_riders_with_the_ride_off_still_agree_every_step():
    riders, tfs, monitors = _riders(2, [10, 10])
    riders[1].enabled = False  # asks the lighthouse every step, and still runs the agreement with the rider
    plan = StepPlan(False, set(), set(), set(), set(), asks={1})
    assert _run_step(plan, riders, tfs, monitors, {0, 1}) == {0: True, 1: True}
    assert tfs[0]._pg.sizes == tfs[1]._pg.sizes == [2 * ROW]


def test_members_that_disagree_on_who_heals_both_discard():
    """A rider averages over every member; a member that got the same quorum id from the lighthouse with
    the rider counted as healing divides by one. They must not both commit that step."""
    riders, tfs, monitors = _riders(2, [10, 10])
    tfs[1].participants = 1  # this member's torchft counts the rider as healing
    plan = StepPlan(False, set(), set(), set(), set(), asks={1})
    assert _run_step(plan, riders, tfs, monitors, {0, 1}) == {0: False, 1: False}


def test_an_error_after_the_sync_discards_only_that_group_on_a_lighthouse_quorum_and_every_rider_otherwise():
    """The divergence guard's outvoted group records its error after every collective of the step. On a
    quorum from the lighthouse it takes part in the agreement (not ok) and only it discards, as with torchft
    alone. In a riding step, every member must be ok."""
    riders, tfs, monitors = _riders(2, [10, 10])
    riders[1].skipped_collective = lambda: False  # its error comes after its all-reduces
    asked = StepPlan(True, set(), set(), set(), {1}, asks={0, 1})
    assert _run_step(asked, riders, tfs, monitors, {0, 1}) == {0: True, 1: False}
    assert tfs[0]._pg.sizes == tfs[1]._pg.sizes == [2 * ROW]

    riders, tfs, monitors = _riders(2, [10, 10])
    riders[1].skipped_collective = lambda: False
    down = StepPlan(False, set(), set(), set(), {1})
    assert _run_step(down, riders, tfs, monitors, {0, 1}) == {0: False, 1: False}


def test_a_group_behind_by_one_step_stops_every_rider():
    riders, tfs, monitors = _riders(2, [10, 9])
    down = StepPlan(False, set(), set(), set(), set())
    assert _run_step(down, riders, tfs, monitors, {0, 1}) == {0: False, 1: False}
    assert _run_step(down, riders, tfs, monitors, {0, 1}) == {}  # both wait for the lighthouse


def test_a_group_that_never_had_a_quorum_waits_for_the_lighthouse():
    r = OutageRider(Torchft(0), enabled=True, lighthouse="lh", group_rank=0, group_size=1,
                    decision_timeout=timedelta(seconds=1), monitor=ScriptedMonitor(False))
    assert r.reuse() is None and not r.riding


plans = st.builds(StepPlan, st.booleans(), st.sets(st.integers(0, 2), max_size=1),
                  st.sets(st.integers(0, 2), max_size=1), st.sets(st.integers(0, 2), max_size=1),
                  st.sets(st.integers(0, 2), max_size=1), st.sets(st.integers(0, 2), max_size=2))


@given(st.lists(plans, min_size=1, max_size=8), st.lists(st.sampled_from([10, 10, 10, 9]), min_size=3, max_size=3))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_adversarial_steps_never_split_the_riders(schedule, steps):
    """Whatever fails, lies or dies: a riding step commits on every member of the quorum or on none, only
    when all were on the same step, and never after a member left for the lighthouse or died."""
    riders, tfs, monitors = _riders(3, steps)
    alive, gone = {0, 1, 2}, False
    for plan in schedule:
        before = {i: tfs[i].step for i in range(3)}
        out = _run_step(plan, riders, tfs, monitors, alive)
        committed = {i for i, c in out.items() if c}
        if any(riders[i].riding for i in out):
            assert committed in (set(), {0, 1, 2}), (plan, out)
        if committed:
            assert not gone and len({before[i] for i in committed}) == 1
        gone |= committed != {0, 1, 2}


def test_a_lighthouse_that_stops_answering_while_a_call_waits_is_probed_again():
    """A probe that answered as the call began must not vouch for the whole call: the lighthouse may hang (or
    its link drop) a moment later. Seen: a 6 s blackhole that began right after such a probe cost 6 s."""

    class Monitor:  # one probe answered just as the call began; every probe after it goes unanswered
        answered_at = None

        def answers(self, since):
            if self.answered_at is None:
                self.answered_at = time.monotonic()
            return True if self.answered_at >= since else False

    r = OutageRider(Torchft(store=None), enabled=True, lighthouse="lh", group_rank=0, group_size=1,
                    decision_timeout=timedelta(seconds=5), monitor=Monitor())
    r.remember(Quorum(1, 0, 2), ["replica_group_0:a", "replica_group_1:b"])
    r.after_commit(True, False)
    hung = threading.Event()
    t0 = time.monotonic()
    r.quorum(lambda timeout: hung.wait(30))
    assert r.riding and time.monotonic() - t0 < 5.0
    hung.set()


@pytest.mark.parametrize("excused", [True, False], ids=["met-rule", "reverted"])
def test_steps_the_group_could_not_meet_in_do_not_count_towards_the_gap_wait(monkeypatch, excused):
    """A holder of the job's history held 24 s in a rendezvous that failed must not stop for a gap it could not
    close meanwhile (the chaos run with a spare, seed 44, lost every holder that way)."""
    import ftbridge.manager.outage as outage
    from ftbridge.manager.commit import Agreement

    now = [0.0]
    r = _rider(gap_wait=timedelta(seconds=10), clock=lambda: now[0])
    gap = Agreement(True, False, False, "follows a quorum nobody here took part in", continuous=False)
    monkeypatch.setattr(outage, "judge", lambda rows, own, riding: gap)

    def step(t, met=True):
        now[0] = t
        r.conclude([0.0], [[0.0]], "") if met else r.conclude(None, None, "the process group never formed")
        r.after_commit(False, False, group_met=met or not excused)

    step(0)
    step(1)
    step(25, met=False)  # the step in the failed rendezvous
    step(26)
    assert r.gap_expired is not excused
    for t in range(27, 34):
        step(t)
    assert r.gap_expired is not excused  # 9 s counted: 0-1 and 25-33
    step(34)
    assert r.gap_expired


def test_a_row_below_torchfts_min_replica_size_is_not_ok():
    """torchft's should_commit refuses with fewer participants than min_replica_size without recording an error.
    An ok row there made the donor of a heal (one participant, --min-replicas 2) count the joiner as committing
    the heal step and record that quorum as missed: with the joiner not vouching for its group, the pair then
    discarded every later quorum (the Accelerate example's kill and heal, in a CI dry run)."""
    from ftbridge.manager.commit import ROW_OK

    r = _rider()
    assert r.own_row()[ROW_OK] == 1.0
    r._manager._min_replica_size = 2
    r._manager.participants = 1
    assert r.own_row()[ROW_OK] == 0.0
    r._manager.participants = 2
    assert r.own_row()[ROW_OK] == 1.0
