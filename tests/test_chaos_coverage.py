"""The chaos run's "same samples" invariant with slots (ftbridge.harness.chaos.coverage), on hand-written records."""

from __future__ import annotations

from ftbridge.harness.chaos.coverage import same_samples


def rec(group, units, step=5, quorum=3, rank=0, participants=2, committed=True):
    return {"replica_group": group, "group_rank": rank, "step": step, "quorum_id": quorum,
            "participants": participants, "committed": committed, "units": units}


def test_two_groups_that_share_the_grid_hold():
    events = [rec(0, [[0, 0], [0, 1]]), rec(1, [[1, 0], [1, 1]]),
              rec(0, [[0, 0], [0, 1], [1, 0], [1, 1]], step=6, quorum=4, participants=1),
              rec(1, [[1, 0]], step=6, quorum=4, participants=1, committed=False),  # a discard counts for nothing
              {"event": "start", "replica_group": 1, "group_rank": 0}]
    check = same_samples(events, slots=2, micro=2)
    assert check.violations == [] and check.judged.startswith("2 committed steps")


def test_a_unit_trained_twice_missing_or_outside_the_grid_is_a_violation():
    twice = same_samples([rec(0, [[0, 0], [0, 1], [1, 0]]), rec(1, [[1, 0], [1, 1]])], 2, 2).violations
    assert len(twice) == 1 and "twice [(1, 0)]" in str(twice[0])
    missing = same_samples([rec(0, [[0, 0], [0, 1]]), rec(1, [[1, 0]])], 2, 2).violations
    assert len(missing) == 1 and "missing [(1, 1)]" in str(missing[0])
    outside = same_samples([rec(0, [[0, 0], [0, 1], [2, 0]]), rec(1, [[1, 0], [1, 1]])], 2, 2).violations
    assert "outside the grid [(2, 0)]" in str(outside[0])
    bare = same_samples([{**rec(0, None), "units": None}], 2, 2).violations
    assert "without its units" in str(bare[0])


def test_a_group_that_died_before_its_record_leaves_only_the_twice_and_outside_checks():
    # participants 2, one record: the other group's commit record was never written
    assert same_samples([rec(0, [[0, 0], [0, 1]])], 2, 2).violations == []
    assert same_samples([rec(0, [[0, 0], [0, 0]])], 2, 2).violations
