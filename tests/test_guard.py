"""Divergence guard: slot encoding, the verdict, and the actions (no network: replicas in threads, tests/fakes.py)."""

from __future__ import annotations

import pytest
import torch

from ftbridge.guard import DivergenceGuard, ReplicaDivergenceError, decode_slots, encode_slot, judge
from tests.fakes import FakeWorld, run_replicas


def test_slots_round_trip_exactly():
    digest = "ffffeeee00011234"
    t = torch.zeros(15, dtype=torch.float64)
    t[5:10] = torch.tensor(encode_slot(7, digest), dtype=torch.float64)
    assert decode_slots(t) == [None, (7, digest), None]
    with pytest.raises(ValueError, match="16 hex digit"):
        encode_slot(0, "abc")


def test_verdict_names_the_groups_that_differ_from_the_primary():
    v = judge([(3, "a" * 16), (0, "a" * 16), (1, "b" * 16), None])
    assert v.primary == 3 and v.differing == [1] and not v.ok
    assert judge([(3, "a" * 16), None]).ok
    assert judge([None, (1, "b" * 16)]).primary is None


class Adapter:
    def __init__(self, value):
        self.value = value

    def fingerprint_tensors(self):
        return [torch.full((3,), self.value)]


class Events:
    def __init__(self):
        self.records = []

    def write(self, **kw):
        self.records.append(kw)


def _run(values, action="heal", step=4):
    """Guards of ``len(values)`` replicas whose state is ``values``, checked concurrently in a fake world."""
    world = FakeWorld(len(values))
    guards = [DivergenceGuard(world.manager(i), Adapter(v), replica_group_id=10 + i, every=2, action=action,
                              events=Events()) for i, v in enumerate(values)]
    return guards, run_replicas(world, lambda i: guards[i].check(step))


def test_a_differing_group_heals_and_the_others_go_on():
    guards, verdicts = _run([1.0, 1.0, 2.0])
    assert [len(g.manager.errors) for g in guards] == [0, 0, 1]
    assert all(v.differing == [12] and v.primary == 10 for v in verdicts)
    assert all(g.events.records[0]["event"] == "divergence" for g in guards)
    assert guards[0].mismatches == 1 and guards[0].checks == 1


def test_identical_groups_pass_and_steps_not_due_are_skipped():
    guards, verdicts = _run([1.0, 1.0])
    assert all(v.ok for v in verdicts) and not guards[0].events.records
    _, skipped = _run([1.0, 2.0], step=3)
    assert skipped == [None, None]


def test_stop_raises_on_every_group():
    _, out = _run([1.0, 2.0], action="stop")
    assert all(isinstance(e, ReplicaDivergenceError) for e in out)


def test_one_ulp_apart_is_a_divergence():
    nudged = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0)).item()
    guards, verdicts = _run([1.0, nudged])
    assert verdicts[0].differing == [11] and len(guards[1].manager.errors) == 1
