"""QuorumHistory (ftbridge.manager.history): how each quorum ends in a rank's history, with no I/O.

The protocol simulation (test_commit_simulation.py) drives it inside the outage rider under faults; these
tests pin each transition alone.
"""

from ftbridge.manager.commit import ROW, ROW_OK, ROW_STEP, Agreement
from ftbridge.manager.history import QuorumHistory

A, B = ("replica_0", "replica_1"), ("replica_0",)


def _passed(continuous=True):
    return Agreement(consistent=True, commit=continuous, ride_on=False, reason="", continuous=continuous)


def _rows(oks, step=0):
    rows = [[0.0] * ROW for _ in oks]
    for row, ok in zip(rows, oks):
        row[ROW_OK] = 1.0 if ok else 0.0
        row[ROW_STEP] = float(step)
    return rows


def _step(h, *, committed, oks=(True, True), own=0, continuous=True, step=0):
    h.agreed(_passed(continuous), _rows(oks, step), own)
    h.decided(committed, group_agreed=True, nobody_commits=False, group_met=True)


def test_a_quorum_this_group_committed_in_becomes_the_certified_one_with_its_committers():
    h = QuorumHistory(30.0)
    h.close(None, (1, A))
    _step(h, committed=True)
    h.close((1, A), (2, B))
    assert (h.certified, h.missed, h.certified_committers, h.dead_ends()) == (1, -1, 2, ())


def test_a_quorum_others_committed_in_while_this_group_discarded_is_missed_not_dead():
    h = QuorumHistory(30.0)
    _step(h, committed=False, oks=(False, True), own=0)
    h.close((4, A), (5, A))
    assert (h.certified, h.missed, h.dead_ends()) == (-1, 4, ())


def test_a_quorum_nobody_committed_in_is_a_dead_end_and_a_later_certified_one_drops_older_dead_ends():
    h = QuorumHistory(30.0)
    h.close((3, A), (4, A))
    h.close((4, A), (6, A))
    h.close((6, A), (7, A))
    assert h.dead_ends() == ((6, 6), (3, 4))
    _step(h, committed=True)
    h.close((7, A), (8, A))
    assert (h.certified, h.dead_ends()) == (7, ())


def test_the_same_quorum_again_closes_nothing():
    h = QuorumHistory(30.0)
    h.close((3, A), (3, A))
    assert h.dead_ends() == ()


def test_a_lighthouse_restart_starts_the_history_anew_and_a_late_answer_from_before_it_is_ignored():
    h = QuorumHistory(30.0)
    _step(h, committed=True)
    h.close((9, A), (10, A))
    epoch = h.epoch
    h.close((10, A), (0, A))  # the id went down: a restarted lighthouse
    assert (h.certified, h.dead_ends(), h.epoch) == (-1, (), epoch + 1)
    with h.lock:
        h.never_joined(epoch, 11, current=0)
    assert h.dead_ends() == ()
    with h.lock:
        h.never_joined(h.epoch, 2, current=0)
    assert h.dead_ends() == ((2, 2),)


def test_a_step_missed_before_a_lighthouse_restart_is_carried_across_it_by_its_number_until_a_commit():
    h = QuorumHistory(30.0)
    h.close(None, (7, A))
    _step(h, committed=True, step=40)
    _step(h, committed=False, oks=(False, True), own=0, step=41)  # the other member may have committed step 41
    h.close((7, A), (8, A))
    assert (h.missed, h.behind) == (7, 0)
    h.close((8, A), (1, A))  # a restarted lighthouse: quorum ids cannot say it any more
    assert (h.missed, h.certified, h.behind) == (-1, -1, 42)
    h.close((1, A), (2, A))
    _step(h, committed=False, oks=(False, False), step=42)
    assert h.behind == 42, "kept through quorums that commit nothing"
    _step(h, committed=True, step=42)
    assert h.behind == 0, "a commit past the restart ends it"


def test_a_missed_step_that_a_later_commit_certified_is_not_carried_across_a_restart():
    h = QuorumHistory(30.0)
    h.close(None, (7, A))
    _step(h, committed=False, oks=(False, True), own=0, step=41)
    h.close((7, A), (8, A))
    _step(h, committed=True, step=42)  # healed from the holder and committed with it
    h.close((8, A), (9, A))
    h.close((9, A), (1, A))
    assert h.behind == 0


def test_certified_members_are_the_current_quorums_once_an_agreement_passed_in_it():
    h = QuorumHistory(30.0)
    assert h.certified_members(A) == ()
    _step(h, committed=True)
    assert h.certified_members(A) == A
    h.close((1, A), (2, B))
    assert h.certified_members(B) == A


def test_non_continuous_quorums_expire_only_after_gap_wait_of_met_steps():
    now = [0.0]
    h = QuorumHistory(5.0, clock=lambda: now[0])
    for t in (0.0, 2.0, 4.0):
        now[0] = t
        _step(h, committed=False, continuous=False)
    assert not h.gap_expired
    now[0] = 6.0
    _step(h, committed=False, continuous=False)
    assert h.gap_expired
    _step(h, committed=True)
    assert not h.gap_expired
