"""Riding out a lighthouse outage: the decision, the agreement, and adversarial step sequences.

No network: riders of one quorum run in threads of this process, joined by a fake process group
whose all-reduce fails for everyone unless every member of the quorum took part (gloo's behaviour
when a peer is missing, without its timeout).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ftbridge.manager.outage import ROW, OutageRider, decide_ride, encode_row, judge_rows, probe_lighthouse

D1, D2 = "0123456789abcdef", "fedcba9876543210"


def test_rows_agree_only_on_the_same_quorum_membership_and_step():
    own = encode_row(4, D1, 100, True, False)
    assert len(own) == ROW
    assert judge_rows([own, own, own], own).commit
    assert judge_rows([own, own], own).all_unreachable
    seen = encode_row(4, D1, 100, True, True)
    v = judge_rows([own, seen], own)
    assert v.commit and not v.all_unreachable
    for other in (encode_row(5, D1, 100, True, False), encode_row(4, D2, 100, True, False),
                  encode_row(4, D1, 99, True, False)):
        assert not judge_rows([own, other], own).commit
    assert "error" in judge_rows([own, encode_row(4, D1, 100, False, False)], own).reason
    assert "missing" in judge_rows([own, [0.0] * ROW], own).reason
    assert "missing" in judge_rows([own, [2 * x for x in own]], own).reason  # a member that wrote twice
    with pytest.raises(ValueError, match="16 hex digit"):
        encode_row(1, "abc", 1, True, False)


def test_ride_needs_a_committed_last_step_and_an_unreachable_lighthouse():
    base = dict(enabled=True, has_last=True, same_process_group=True, last_committed=True, rode_last=False,
                last_all_unreachable=False, lighthouse_reachable=False)
    assert decide_ride(**base)
    for name in ("enabled", "has_last", "same_process_group", "last_committed"):
        assert not decide_ride(**{**base, name: False}), name
    assert not decide_ride(**{**base, "lighthouse_reachable": True})
    assert not decide_ride(**{**base, "lighthouse_reachable": None})
    # Staying on follows the shared agreement, not this rank's own probe.
    assert decide_ride(**{**base, "rode_last": True, "last_all_unreachable": True, "lighthouse_reachable": True})
    assert not decide_ride(**{**base, "rode_last": True, "last_all_unreachable": False})


def test_probe_tells_a_closed_port_from_an_open_one():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        assert probe_lighthouse(f"http://127.0.0.1:{port}")
    assert not probe_lighthouse(f"http://127.0.0.1:{port}")
    assert not probe_lighthouse("http://no-such-host.invalid:1")


@given(st.lists(st.tuples(st.sampled_from([3, 4]), st.sampled_from([D1, D2]), st.sampled_from([7, 8]),
                          st.booleans(), st.booleans(), st.sampled_from([0.0, 1.0, 2.0])), min_size=1, max_size=4))
@settings(max_examples=300, deadline=None)
def test_no_two_members_commit_on_different_quorums_or_steps(members):
    """Whatever the members write (and however often), all members judge one summed tensor: if any two
    commit, they commit the same quorum, membership and step, and so does every member."""
    rows = [[present * v for v in encode_row(q, d, s, ok, seen)] for q, d, s, ok, seen, present in members]
    owns = [encode_row(q, d, s, ok, seen) for q, d, s, ok, seen, _ in members]
    committed = [own for own in owns if judge_rows(rows, own).commit]
    if committed:
        assert all(present == 1.0 and ok for *_, ok, _, present in members)
        assert len({tuple(o[1:7]) for o in owns}) == 1


# -- riders in threads ------------------------------------------------------------------------------
class Phase:
    """One collective of one step: every riding group calls ``allreduce`` or ``absent`` exactly once."""

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


class SimPG:
    def __init__(self) -> None:
        self.phase: Optional[Phase] = None
        self.rank = 0
        self.sizes: List[int] = []
        """Sizes of the all-reduces issued, in order: gloo pairs the n-th of every member, and aborts on a mismatch."""

    def errored(self):
        return None

    def allreduce(self, tensors, opts):
        self.sizes.append(tensors[0].numel())
        self.phase.allreduce(self.rank, tensors[0])
        return Work()


class SimTorchft:
    """What the rider reads of torchft's Manager."""

    def __init__(self, step: int) -> None:
        self._quorum_id = 1
        self._pg = SimPG()
        self._store = None
        self.step = step
        self.error: Optional[Exception] = None

    def errored(self):
        return self.error

    def report_error(self, e):
        self.error = self.error or e

    def current_step(self):
        return self.step


@dataclass
class Quorum:
    quorum_id: int
    replica_rank: int
    replica_world_size: int
    store_address: str = "store"


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
    riders, tfs, probes = [], [], {}
    for i in range(n):
        tf = SimTorchft(steps[i])
        tf._pg.rank = i
        r = OutageRider(tf, enabled=True, lighthouse=f"lh{i}", group_rank=0, group_size=1,
                        decision_timeout=None, probe=lambda addr: probes[addr])
        r.remember(Quorum(1, i, n), ids)
        r.after_commit(True)
        riders.append(r)
        tfs.append(tf)
    return riders, tfs, probes


def _run_step(plan: StepPlan, riders, tfs, probes, alive: Set[int]) -> Dict[int, bool]:
    """One step of every live group; returns {group: committed} for the groups that rode it or asked the lighthouse
    (:attr:`StepPlan.asks`)."""
    n = len(riders)
    alive -= plan.dies
    riding = []
    for i in sorted(alive):
        probes[f"lh{i}"] = plan.lighthouse_up != (i in plan.probe_lies)
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
        riders[i].before_commit()
        agree.absent(i)
        committed = tf.error is None
        tf.step += committed
        riders[i].after_commit(committed)
        out[i] = committed

    threads = [threading.Thread(target=one, args=(i,)) for i in riding]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    for i in sorted(alive - set(riding)):
        riders[i].after_commit(False)  # waits for the lighthouse: this sketch never brings it back
    return out


def test_all_groups_ride_a_clean_outage_and_leave_it_together():
    riders, tfs, probes = _riders(3, [10, 10, 10])
    alive = {0, 1, 2}
    down = StepPlan(False, set(), set(), set(), set())
    for _ in range(5):
        assert _run_step(down, riders, tfs, probes, alive) == {0: True, 1: True, 2: True}
    assert [tf.step for tf in tfs] == [15, 15, 15]
    # The lighthouse answers group 1's probe only: that step still rides (decided by the last agreement),
    # and every group leaves at the next one.
    assert _run_step(StepPlan(False, {1}, set(), set(), set()), riders, tfs, probes, alive) == {0: True, 1: True,
                                                                                                   2: True}
    assert _run_step(down, riders, tfs, probes, alive) == {}
    assert [r.rides for r in riders] == [6, 6, 6] and [r.ride_commits for r in riders] == [6, 6, 6]


def test_a_group_that_asked_the_lighthouse_runs_the_riders_collectives_and_commits_with_them():
    """Entry into riding is per group (each probes the lighthouse itself). A group that reached the
    lighthouse and got the same quorum must issue the very collectives the riders issue in that step:
    gloo pairs the n-th all-reduce of every member and aborts the process on a size mismatch (seen in
    CI when only riders ran the agreement)."""
    riders, tfs, probes = _riders(3, [10, 10, 10])
    # The lighthouse dies between group 1's probe and the others': 0 and 2 ride, 1 asks and gets quorum 1 again.
    plan = StepPlan(False, {1}, set(), set(), set(), asks={1})
    assert _run_step(plan, riders, tfs, probes, {0, 1, 2}) == {0: True, 1: True, 2: True}
    assert [r.riding for r in riders] == [True, False, True]
    assert tfs[0]._pg.sizes == tfs[1]._pg.sizes == tfs[2]._pg.sizes == [3 * ROW]  # the gradients: Phase, not SimPG
    assert [tf.step for tf in tfs] == [11, 11, 11]


def test_an_error_after_the_sync_discards_only_that_group_on_a_lighthouse_quorum_and_every_rider_otherwise():
    """The divergence guard's differing group records its error after every collective of the step. On a
    quorum from the lighthouse it takes part in the agreement (not ok) and only it discards, as with torchft
    alone: the primary commits, and the differing group heals from it next (before, both discarded that
    step again and again, for as long as the job ran). In a riding step, every member must be ok."""
    riders, tfs, probes = _riders(2, [10, 10])
    riders[1].skipped_collective = lambda: False  # its error comes after its all-reduces
    asked = StepPlan(True, set(), set(), set(), {1}, asks={0, 1})
    assert _run_step(asked, riders, tfs, probes, {0, 1}) == {0: True, 1: False}
    assert tfs[0]._pg.sizes == tfs[1]._pg.sizes == [2 * ROW]

    riders, tfs, probes = _riders(2, [10, 10])
    riders[1].skipped_collective = lambda: False
    down = StepPlan(False, set(), set(), set(), {1})
    assert _run_step(down, riders, tfs, probes, {0, 1}) == {0: False, 1: False}


def test_a_group_behind_by_one_step_stops_every_rider():
    riders, tfs, probes = _riders(2, [10, 9])
    down = StepPlan(False, set(), set(), set(), set())
    assert _run_step(down, riders, tfs, probes, {0, 1}) == {0: False, 1: False}
    assert _run_step(down, riders, tfs, probes, {0, 1}) == {}  # both wait for the lighthouse


def test_a_group_that_never_had_a_quorum_waits_for_the_lighthouse():
    tf = SimTorchft(0)
    r = OutageRider(tf, enabled=True, lighthouse="lh", group_rank=0, group_size=1, decision_timeout=None,
                    probe=lambda addr: False)
    assert r.reuse() is None and not r.riding


def test_a_rank_follows_its_group_rank_0_through_the_store():
    class Store:
        def __init__(self):
            self.kv = {}

        def set(self, k, v):
            self.kv[k] = v

        def delete_key(self, k):
            self.kv.pop(k, None)

        def wait(self, keys, timeout):
            if not all(k in self.kv for k in keys):
                raise TimeoutError(keys)

        def get(self, k):
            return self.kv[k]

    store = Store()
    ranks = []
    for rank in (0, 1):
        tf = SimTorchft(10)
        tf._store = store
        # Rank 1's own probe would say "reachable"; it must follow rank 0 anyway.
        r = OutageRider(tf, enabled=True, lighthouse="lh", group_rank=rank, group_size=2, decision_timeout=None,
                        probe=lambda addr, rank=rank: rank == 1)
        r.remember(Quorum(1, 0, 2), ["a", "b"])
        r.after_commit(True)
        ranks.append(r)
    assert ranks[0].reuse() is not None and ranks[1].reuse() is not None
    ranks[1]._seq += 5  # rank 0 never wrote this step's decision: rank 1 asks the lighthouse
    assert ranks[1].reuse() is None


plans = st.builds(StepPlan, st.booleans(), st.sets(st.integers(0, 2), max_size=1),
                  st.sets(st.integers(0, 2), max_size=1), st.sets(st.integers(0, 2), max_size=1),
                  st.sets(st.integers(0, 2), max_size=1), st.sets(st.integers(0, 2), max_size=2))


@given(st.lists(plans, min_size=1, max_size=8), st.lists(st.sampled_from([10, 10, 10, 9]), min_size=3, max_size=3))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_adversarial_steps_never_split_the_riders(schedule, steps):
    """Whatever fails, lies or dies: a riding step commits on every member of the quorum or on none, only
    when all were on the same step, and never after a member left for the lighthouse or died."""
    riders, tfs, probes = _riders(3, steps)
    alive, gone = {0, 1, 2}, False
    for plan in schedule:
        before = {i: tfs[i].step for i in range(3)}
        out = _run_step(plan, riders, tfs, probes, alive)
        committed = {i for i, c in out.items() if c}
        assert committed in (set(), {0, 1, 2}), (plan, out)
        if committed:
            assert not gone and len({before[i] for i in committed}) == 1
        gone |= committed != {0, 1, 2}
