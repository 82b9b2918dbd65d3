"""The divergence guard: fingerprints when due, the majority verdict, and what each setting does with it."""

from __future__ import annotations

import pytest
import torch

from ftbridge.guard import DivergenceGuard, ReplicaDivergenceError
from ftbridge.manager.commit import GroupDecision, judge_guard

A, B, C = "a" * 16, "b" * 16, "c" * 16


def test_the_majority_decides_and_the_primary_is_not_the_reference():
    # Group 0 (the quorum's primary) holds the odd state out: it is the one that differs.
    v = judge_guard({0: B, 1: A, 2: A})
    assert v.majority == A and v.differing == (0,) and v.agreeing == (1, 2) and not v.ok and not v.tie
    assert judge_guard({0: A, 1: A}).ok
    assert judge_guard({}).ok and judge_guard({3: A}).ok


@pytest.mark.parametrize("digests", [{0: A, 1: B}, {0: A, 1: A, 2: B, 3: B}, {0: A, 1: B, 2: C}])
def test_no_majority_is_a_tie_that_names_nobody(digests):
    v = judge_guard(digests)
    assert v.tie and v.majority is None and v.differing == () and v.agreeing == ()


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


def _decision(mismatch=False, differs=False, tie=False):
    return GroupDecision(commit=not differs, drop_heal=False, guard_mismatch=mismatch, guard_differs=differs,
                         guard_tie=tie, ride_next=False, stop=False, gap_stop=False, reason="")


def _guard(action="heal", on_tie="stop", value=1.0):
    return DivergenceGuard(Adapter(value), replica_group_id=1, every=2, action=action, on_tie=on_tie, events=Events())


def test_fingerprints_only_when_due_and_one_ulp_apart_differs():
    g = _guard()
    assert g.digest(3) is None and g.digest(0) is None
    nudged = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0)).item()
    assert g.digest(4) == _guard().digest(4) != _guard(value=nudged).digest(4)
    assert len(g.digest(4)) == 16


def test_an_outvoted_group_records_the_event_naming_the_majority_and_heals():
    g = _guard()
    v = judge_guard({0: A, 1: B, 2: A})
    g.act(4, v, _decision(mismatch=True, differs=True))
    (e,) = g.events.records
    assert e["event"] == "divergence" and e["differing_groups"] == [1] and e["majority_groups"] == [0, 2]
    assert e["action"] == "heal" and e["this_group_differs"] and not e["tie"]
    assert g.mismatches == 1 and g.checks == 1


def test_a_group_of_the_majority_goes_on():
    g = _guard()
    g.act(4, judge_guard({0: A, 1: A, 2: B}), _decision(mismatch=True))
    assert g.events.records[0]["action"] == "go on"


def test_identical_groups_leave_no_event():
    g = _guard()
    g.act(4, judge_guard({0: A, 1: A}), _decision())
    g.act(4, None, _decision())
    assert not g.events.records and g.checks == 1 and g.mismatches == 0


def test_a_tie_stops_by_default_and_is_only_flagged_when_asked():
    v = judge_guard({0: A, 1: B})
    with pytest.raises(ReplicaDivergenceError, match="none can be named right"):
        _guard().act(4, v, _decision(mismatch=True, tie=True))
    g = _guard(on_tie="flag")
    g.act(4, v, _decision(mismatch=True, tie=True))
    assert g.events.records[0]["tie"] and g.events.records[0]["action"] == "go on"


def test_stop_raises_on_any_mismatch_naming_the_states():
    with pytest.raises(ReplicaDivergenceError, match=r"groups \[0, 2\] hold a{16}"):
        _guard(action="stop").act(4, judge_guard({0: A, 1: B, 2: A}), _decision(mismatch=True))


def test_bad_settings_are_refused():
    for kw in (dict(every=-1), dict(action="ignore"), dict(on_tie="heal")):
        with pytest.raises(ValueError):
            DivergenceGuard(Adapter(1.0), replica_group_id=0, events=Events(),
                            **{"every": 1, "action": "heal", "on_tie": "stop", **kw})
