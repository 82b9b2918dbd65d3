"""Divergence guard: slot encoding, the verdict, and the actions (no network: a fake all-reduce)."""

from __future__ import annotations

import pytest
import torch

from ftbridge.events import tensor_checksum
from ftbridge.guard import SLOT, DivergenceGuard, ReplicaDivergenceError, decode_slots, encode_slot, judge


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


class FakeManager:
    """One replica of an in-process job: ``allreduce`` returns work that fills in the job's SUM."""

    def __init__(self, job, rank):
        self.job, self.replica_rank, self.healed = job, rank, 0

    @property
    def participants(self):
        return len(self.job["values"])

    def allreduce(self, tensor, reduce_op=None):
        total = self.job["total"]
        return type("Work", (), {"wait": lambda self: tensor.copy_(total.view_as(tensor))})()

    def report_error(self, e):
        self.healed += 1  # the group discards this step; torchft heals it at the next quorum


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
    """Guards of ``len(values)`` replicas whose state is ``values``; the SUM all-reduce is computed up front."""
    job = {"values": values}
    guards = [DivergenceGuard(FakeManager(job, i), Adapter(v), replica_group_id=10 + i, every=2, action=action,
                              events=Events()) for i, v in enumerate(values)]
    total = torch.zeros(len(values) * SLOT, dtype=torch.float64)
    for i, g in enumerate(guards):
        digest = tensor_checksum(g.adapter.fingerprint_tensors())
        total[i * SLOT:(i + 1) * SLOT] += torch.tensor(encode_slot(g.group_id, digest), dtype=torch.float64)
    job["total"] = total
    out = []
    for g in guards:
        try:
            out.append(g.check(step))
        except ReplicaDivergenceError as e:
            out.append(e)
    return guards, out


def test_a_differing_group_heals_and_the_others_go_on():
    guards, verdicts = _run([1.0, 1.0, 2.0])
    assert [g.manager.healed for g in guards] == [0, 0, 1]
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
    assert verdicts[0].differing == [11] and guards[1].manager.healed == 1
