"""The commit protocol's pure decisions (ftbridge.manager.commit): rows, verdicts, the group decision, the waits."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftbridge.manager.commit import (
    DEAD_END_RUNS,
    FLAGS,
    ROW,
    Agreement,
    Flags,
    QuorumWait,
    View,
    continuous,
    dead_end_runs,
    decide_group,
    decide_ride,
    encode_flags,
    encode_view,
    id_runs,
    judge,
    membership_digest,
    rank_flags,
)
from ftbridge.manager.stand_aside import StandAside, longest_pause

D1, D2 = "0123456789abcdef", "fedcba9876543210"
G1, G2 = "1111111111111111", "2222222222222222"


def view(group=0, qid=4, digest=D1, step=100, participants=2, participating=True, ok=True, seen=False, guard=None):
    return View(group, qid, digest, step, participants, participating, ok, seen, guard)


def test_a_member_still_waiting_on_a_call_it_left_keeps_every_member_riding():
    """A member whose left lighthouse call is in flight must not see the others go back: its call's request
    may still reach the lighthouse with an old step, and a quorum formed from it would be one that member never
    hears (seen with real processes: a 10 s stall after a dead lighthouse came back)."""
    heard, holding = encode_view(view(0, seen=True)), encode_view(replace(view(1), holding=True))
    assert not judge([heard, encode_view(view(1))], heard, riding=True).ride_on
    v = judge([heard, holding], heard, riding=True)
    assert v.commit and v.ride_on


def test_rows_agree_only_on_the_same_quorum_membership_step_and_divisor():
    a, b = encode_view(view(0)), encode_view(view(1))
    assert len(a) == ROW
    v = judge([a, b], a, riding=True)
    assert v.consistent and v.commit and v.ride_on and v.guard is None
    assert not judge([a, encode_view(view(1, seen=True))], a, riding=True).ride_on
    for other in (view(1, qid=5), view(1, digest=D2), view(1, step=99), view(1, participants=1)):
        verdict = judge([a, encode_view(other)], a, riding=False)
        assert not verdict.consistent and not verdict.commit, other
    assert "missing" in judge([a, [0.0] * ROW], a, riding=False).reason
    assert "missing" in judge([a, [2 * x for x in b]], a, riding=False).reason  # a member that wrote twice
    with pytest.raises(ValueError, match="16 hex digits"):
        encode_view(view(digest="abc"))
    with pytest.raises(ValueError, match="step=-1"):
        encode_view(view(step=-1))


def test_members_with_different_slot_plans_never_commit_together():
    # Groups configured with different slots, accumulation steps or micro-batches would cover the step's
    # units differently (ftbridge.slots.steps.plan_digest): a sample lost or trained twice. Same plan: commit.
    a, b = encode_view(replace(view(0), plan=7)), encode_view(replace(view(1), plan=7))
    assert judge([a, b], a, riding=False).commit
    c = encode_view(replace(view(1), plan=8))
    for own in (a, c):
        verdict = judge([a, c], own, riding=False)
        assert not verdict.consistent and "slot plans" in verdict.reason
    assert not judge([a, encode_view(view(1))], a, riding=False).commit  # one member without slots


def test_the_divisor_must_match_the_members_that_participate():
    # Both say "2 participants" but one member heals (participating=False): only one gradient is in the sum.
    a, b = encode_view(view(0)), encode_view(view(1, participating=False))
    assert "disagree on who heals" in judge([a, b], a, riding=False).reason
    c, d = encode_view(view(0, participants=1)), encode_view(view(1, participants=1, participating=False))
    assert judge([c, d], c, riding=False).commit  # a joiner that heals: the one participant divides by 1


def test_a_riding_step_needs_every_member_ok_a_lighthouse_step_does_not():
    a, b = encode_view(view(0)), encode_view(view(1, ok=False))
    assert not judge([a, b], a, riding=True).commit and "recorded an error" in judge([a, b], a, riding=True).reason
    assert judge([a, b], a, riding=False).commit


def test_a_member_that_got_the_quorum_from_the_lighthouse_judges_a_riding_step_by_the_riders_rule():
    """One quorum id, two ways: a member rides it while the other got it from the lighthouse again (every member
    asked). A rider with an error discards believing nobody commits; a member applying the lighthouse rule
    committed, and the step was lost once it died (found by the simulation)."""
    rider, asker = encode_view(replace(view(0, ok=False), riding=True)), encode_view(view(1, seen=True))
    assert not judge([rider, asker], asker, riding=False).commit
    assert "recorded an error in this riding step" in judge([rider, asker], asker, riding=False).reason
    assert not judge([rider, asker], rider, riding=True).commit
    ok_rider = encode_view(replace(view(0), riding=True))
    assert judge([ok_rider, asker], asker, riding=False).commit


def test_the_guard_verdict_comes_from_every_participating_fingerprint():
    rows = [encode_view(view(g, participants=3, guard=d)) for g, d in ((0, G2), (1, G1), (2, G1))]
    v = judge(rows, rows[0], riding=False)
    assert v.guard.differing == (0,) and v.guard.agreeing == (1, 2)
    healer = [encode_view(view(0, participants=1, guard=G1)), encode_view(view(1, participants=1,
                                                                             participating=False, guard=None))]
    assert judge(healer, healer[0], riding=False).guard.ok


@given(st.lists(st.tuples(st.sampled_from([3, 4]), st.sampled_from([D1, D2]), st.sampled_from([7, 8]),
                          st.sampled_from([2, 3]), st.booleans(), st.booleans(), st.booleans(),
                          st.sampled_from([0.0, 1.0, 2.0])), min_size=1, max_size=4), st.booleans())
@settings(max_examples=300, deadline=None)
def test_no_two_members_commit_different_views(members, riding):
    """Whatever the members write (and however often), every member judges one summed tensor: if any member
    commits, every member is present once and all hold the same quorum, membership, step and divisor."""
    owns = [encode_view(view(i, q, d, s, n, part, ok)) for i, (q, d, s, n, part, ok, _, _) in enumerate(members)]
    rows = [[m[-1] * x for x in own] for m, own in zip(members, owns)]
    committed = [own for own in owns if judge(rows, own, riding=riding).commit]
    if committed:
        assert all(m[-1] == 1.0 for m in members)
        assert len({tuple(o[2:9]) for o in owns}) == 1
        assert sum(1 for o in owns if o[9] == 1.0) == int(owns[0][8])
        assert len(committed) == len(owns)


def test_membership_digest_ignores_order():
    assert membership_digest(["b:2", "a:1"]) == membership_digest(["a:1", "b:2"]) != membership_digest(["a:1"])


# -- the group's decision ------------------------------------------------------------------------------
def rows(*flags):
    return [encode_flags(f) for f in flags]


def test_every_rank_ok_commits_and_rides_on_only_if_every_rank_heard_nothing():
    ok = Flags(step=5, errored=False, agreement=True, ride_on=True)
    d = decide_group(rows(ok, ok))
    assert d.commit and d.ride_next and not d.drop_heal and d.reason == ""
    assert not decide_group(rows(ok, Flags(step=5, errored=False, agreement=True))).ride_next


@pytest.mark.parametrize("bad, why", [
    (Flags(step=5, errored=True, agreement=True), "recorded an error"),
    (Flags(step=5, errored=False, agreement=False), "agreement failed"),
    (Flags(step=4, errored=False, agreement=True), "different steps"),
    (Flags(step=5, errored=False, agreement=True, guard_mismatch=True, guard_differs=True), "outvoted"),
    (Flags(step=5, errored=False, agreement=True, stop=True), "stops it"),
])
def test_one_rank_s_trouble_discards_the_whole_group(bad, why):
    ok = Flags(step=5, errored=False, agreement=True)
    for order in ((ok, bad), (bad, ok)):
        d = decide_group(rows(*order))
        assert not d.commit and why in d.reason and not d.ride_next


def test_a_heal_one_rank_lacks_is_dropped_on_every_rank():
    ready = Flags(step=40, errored=False, agreement=True, healing=True, heal_ready=True)
    lacks = Flags(step=40, errored=True, agreement=True, healing=True, heal_ready=False)
    assert decide_group(rows(ready, lacks)).drop_heal
    assert not decide_group(rows(ready, ready)).drop_heal
    # A rank that heals while its group mate does not: the group is split on the quorum, never apply it.
    assert decide_group(rows(ready, Flags(step=40, errored=False, agreement=True))).drop_heal


def test_a_missing_or_doubled_rank_is_an_error_not_a_guess():
    ok = encode_flags(Flags(step=5, errored=False, agreement=True))
    assert len(ok) == FLAGS
    with pytest.raises(ValueError, match="rank 1"):
        decide_group([ok, [0.0] * FLAGS])
    with pytest.raises(ValueError, match="rank 0"):
        decide_group([[2 * x for x in ok], ok])


@given(st.lists(st.builds(Flags, step=st.sampled_from([3, 4]), errored=st.booleans(), agreement=st.booleans(),
                          ride_on=st.booleans(), healing=st.booleans(), heal_ready=st.booleans(),
                          guard_mismatch=st.booleans(), guard_differs=st.booleans(), guard_tie=st.booleans(),
                          stop=st.booleans(), store_unreachable=st.booleans()), min_size=1, max_size=4))
@settings(max_examples=300, deadline=None)
def test_the_decision_is_a_function_of_the_whole_group_only(flags):
    """Every rank sees the same rows (the exchange), so every rank takes the same decision; and a commit
    needs every rank clean."""
    table = rows(*flags)
    d = decide_group(table)
    assert all(decide_group(list(table)) == d for _ in flags)
    if d.commit:
        assert all(not f.errored and f.agreement and not f.guard_differs and not f.stop for f in flags)
        assert len({f.step for f in flags}) == 1
    assert d.store_unreachable == any(f.store_unreachable for f in flags)


# -- ASIDE -----------------------------------------------------------------------------------------------
def test_a_group_stands_aside_after_two_silent_quorums_and_the_pause_doubles_until_it_commits():
    rule = StandAside(base_s=30.0)
    assert rule.step(quorum_id=5, store_unreachable=True, committed=False) == 0.0
    assert rule.step(quorum_id=5, store_unreachable=True, committed=False) == 0.0, "one quorum is no evidence"
    assert rule.step(quorum_id=6, store_unreachable=True, committed=False) == 30.0
    pauses = [rule.step(quorum_id=q, store_unreachable=True, committed=False) for q in range(7, 17)]
    assert [p for p in pauses if p] == [60.0, 120.0, 240.0, 240.0, 240.0], "doubling, capped at 8 x"
    assert rule.step(quorum_id=17, store_unreachable=False, committed=True) == 0.0
    rule.step(quorum_id=18, store_unreachable=True, committed=False)
    assert rule.step(quorum_id=19, store_unreachable=True, committed=False) == 30.0, "a commit resets the pause"


def test_a_reachable_store_or_a_commit_between_silences_breaks_the_run():
    rule = StandAside(base_s=1.0)
    for between in (dict(store_unreachable=False, committed=False), dict(store_unreachable=True, committed=True)):
        assert rule.step(quorum_id=1, store_unreachable=True, committed=False) == 0.0
        assert rule.step(quorum_id=2, **between) == 0.0
        assert rule.step(quorum_id=3, store_unreachable=True, committed=False) == 0.0
        rule.step(quorum_id=4, store_unreachable=False, committed=True)
    with pytest.raises(ValueError, match="after=0"):
        StandAside(after=0, base_s=1.0)
    with pytest.raises(ValueError, match="base_s=0"):
        StandAside(base_s=0)


# -- QUORUM ----------------------------------------------------------------------------------------------
def test_ride_needs_a_committed_last_step_and_a_lighthouse_that_does_not_answer():
    base = dict(enabled=True, has_last=True, same_process_group=True, last_committed=True, rode_last=False,
                last_ride_on=False, lighthouse_answers=False)
    assert decide_ride(**base)
    for name in ("enabled", "has_last", "same_process_group", "last_committed"):
        assert not decide_ride(**{**base, name: False}), name
    assert not decide_ride(**{**base, "lighthouse_answers": True})
    assert not decide_ride(**{**base, "lighthouse_answers": None})
    # Staying on follows the shared agreement, not this rank's own probe.
    assert decide_ride(**{**base, "rode_last": True, "last_ride_on": True, "lighthouse_answers": True})
    assert not decide_ride(**{**base, "rode_last": True, "last_ride_on": False})


def test_a_lighthouse_call_is_waited_for_until_a_ride_or_its_deadline():
    w = QuorumWait(started=100.0, deadline_s=30.0, may_ride=True)
    assert w.poll(100.1, None) == w.WAIT and w.poll(100.1, True) == w.WAIT
    assert w.poll(100.2, False) == w.RIDE
    assert w.poll(130.0, True) == w.EXPIRED
    no_ride = QuorumWait(started=100.0, deadline_s=30.0, may_ride=False)
    assert no_ride.poll(100.2, False) == w.WAIT and no_ride.poll(131.0, False) == w.EXPIRED
    with pytest.raises(ValueError):
        QuorumWait(started=0.0, deadline_s=0.0, may_ride=True)


def test_continuity_counts_quorums_a_member_stayed_behind_in_and_the_committers_that_vouch_for_a_gap():
    # (certified, dead-end runs, committers) per member
    assert continuous(5, [(4, (), 2)]) is None                          # follows the certified quorum
    assert continuous(7, [(4, (), 2), (-1, ((5, 6),), 0)]) is None      # 5 and 6 dead ends of a member
    assert continuous(7, [(4, (), 2), (-1, ((5, 5),), 0)]) == 6         # 6: nobody here took part
    assert continuous(7, [(4, (), 1)]) is None                          # the only committer of 4 is here
    assert continuous(7, [(4, (), 2), (3, (), 2)]) == 5                 # one of 4's two committers is missing
    assert continuous(7, [(4, (), 2), (4, (), 2)]) is None              # both are here
    assert continuous(5, [(3, (), 1)], missed=4) == 4                   # a member discarded where others committed
    assert continuous(7, [(3, (), 1), (5, (), 1)], missed=4) is None    # ... a member holds a later history
    assert continuous(2, [(-1, (), 0)], missed=1) == 1                  # even with nothing certified


def test_continuity_takes_the_union_of_every_members_dead_end_runs():
    """The seed-55 soak's quorums: 9 committed by 3 groups; group 1 then took part in 10 (its process group never
    formed), 12 and 13; a spare that took group 0's id formed 11 alone. Groups 1 and 2 and the spare in 14 hold
    every id after 9 between them, but only with group 1's older run: its newest alone (12, 13) leaves 10 open."""
    group1, group2, spare = (9, ((12, 13), (10, 10)), 3), (9, (), 3), (-1, ((11, 13),), 0)
    assert continuous(14, [group1, group2, spare]) is None
    assert continuous(14, [(9, ((12, 13),), 3), group2, spare]) == 10
    assert continuous(14, [group1, group2]) == 11                        # nobody here was in 11
    assert continuous(14, [(9, ((12, 13), (10, 11)), 3), group2]) is None  # runs in any order
    assert id_runs({10, 12, 13}, DEAD_END_RUNS) == ((12, 13), (10, 10))
    assert id_runs({1, 3, 5, 7}, 2) == ((7, 7), (5, 5)) and id_runs((), 3) == ()


def test_every_dead_end_run_travels_in_the_row_and_too_many_are_refused():
    runs = tuple((10 * k, 10 * k + 3) for k in range(DEAD_END_RUNS, 0, -1))
    a = encode_view(View(0, 99, D1, 10, 1, True, True, False, certified=4, dead_ends=runs, committers=2))
    assert len(a) == ROW and dead_end_runs(a) == runs
    assert judge([a], a, riding=False).continuous is False                 # 5..9 are not covered
    b = encode_view(View(0, 99, D1, 10, 1, True, True, False, certified=4, dead_ends=((5, 98),), committers=2))
    assert dead_end_runs(b) == ((5, 98),) and judge([b], b, riding=False).commit
    with pytest.raises(ValueError, match="dead-end runs"):
        encode_view(View(0, 99, D1, 10, 1, True, True, False, dead_ends=((1, 1),) * (DEAD_END_RUNS + 1)))


def test_judge_reads_missed_and_committers_from_the_rows():
    a = encode_view(View(0, 7, D1, 10, 1, True, True, False, certified=4, committers=1))
    assert judge([a], a, riding=False).commit
    b = encode_view(View(0, 7, D1, 10, 1, True, True, False, certified=4, committers=2))
    assert "follows quorum 5" in judge([b], b, riding=False).reason
    c = encode_view(View(0, 7, D1, 10, 1, True, True, False, certified=4, committers=1, missed=6))
    assert "discarded a step of quorum 6" in judge([c], c, riding=False).reason


def test_a_step_missed_before_a_lighthouse_restart_blocks_quorums_behind_it_unless_the_whole_job_is_here():
    def member(group, step, behind=0, participating=True, empty=False):
        return encode_view(replace(view(group, qid=2, step=step, participants=1 + (step > 0)), behind=behind,
                                   participating=participating, num_groups=2, empty=empty))

    # group 0 missed step 41 before the restart; group 1 was restarted empty and heals from it at step 41
    rows = [member(0, 41, behind=42), member(1, 41, participating=False, empty=True)]
    rows[0][8] = rows[1][8] = 1.0  # one participant: the healer does not count
    verdict = judge(rows, rows[0], riding=False)
    assert verdict.consistent and not verdict.commit
    assert "discarded step 41 before the lighthouse restarted" in verdict.reason
    ahead = [member(0, 42, behind=42, participating=False), member(1, 42)]  # a holder of step 42 is here: heal
    ahead[0][8] = ahead[1][8] = 1.0
    assert judge(ahead, ahead[0], riding=False).commit
    whole = [member(0, 41, behind=42), member(1, 41)]  # every group on its own state: nobody trained beyond it
    assert judge(whole, whole[0], riding=False).commit


def test_no_pause_outlasts_half_of_the_wait_the_others_keep_after_a_lighthouse_restart():
    assert longest_pause(30.0, 30.0) == 15.0 and longest_pause(5.0, 300.0) == 40.0 and longest_pause(5.0, 0) == 40.0
    rule = StandAside(base_s=10.0, max_s=longest_pause(10.0, 30.0))
    pauses = [rule.step(quorum_id=q, store_unreachable=True, committed=False) for q in range(8)]
    assert [p for p in pauses if p] == [10.0, 15.0, 15.0, 15.0]


def test_a_group_met_the_others_only_if_every_rank_did():
    # A rank whose agreement never ran (its process group did not form) or found members missing did not meet.
    ran = rank_flags(step=5, errored=False, agreement=Agreement(True, False, False, "gap"), healing=False,
                     heal_ready=False, replica_group=0)
    lost = rank_flags(step=5, errored=True, agreement=Agreement(False, False, False, "no group"), healing=False,
                      heal_ready=False, replica_group=0)
    assert ran.met and not lost.met
    assert decide_group(rows(ran, ran)).met and not decide_group(rows(ran, lost)).met


def test_a_replacement_that_healed_from_a_peer_behind_its_group_cannot_vouch_for_that_group():
    """Chaos seed 72: quorum 8 = groups 0 and 2 committed steps 3218-3322, then both died; group 2's restart and
    group 0's replacement healed at 3217 from group 1, which missed quorum 8. All three ids were present, each
    member training on "state of its own", so the quorum counted as the whole job and committed step 3218 again:
    105 committed steps lost. A joiner vouches for its group only once it has committed."""
    def member(group, borrowed, certified=-1, committers=0):
        return encode_view(replace(view(group, qid=25, step=3217, participants=3), certified=certified,
                                   committers=committers, num_groups=3, borrowed=borrowed))

    rows = [member(0, True), member(1, False, certified=7, committers=3), member(2, True)]
    verdict = judge(rows, rows[1], riding=False)
    assert verdict.consistent and not verdict.continuous and not verdict.commit
    assert "quorum 25 follows quorum 8" in verdict.reason
    own = [member(0, False), member(1, False, certified=7, committers=3), member(2, False)]
    assert judge(own, own[1], riding=False).commit  # every group by a member with its own history: nobody else trained
    assert not judge(rows, rows[1], riding=False).all_empty  # a healed joiner holds the job's state (heal.py's rule)
