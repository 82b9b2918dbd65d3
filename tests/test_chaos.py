"""Chaos schedule and invariants: pure functions, checked on hand-written event records."""

from __future__ import annotations

import time

import pytest

from ftbridge.harness.chaos import invariants as inv
from ftbridge.harness.chaos.schedule import FailureKind, make_schedule, parse_kinds


def test_schedule_is_seeded_has_every_kind_and_brings_the_group_back():
    kinds = list(FailureKind)
    a = make_schedule(seed=7, kinds=kinds, num_groups=3)
    assert a == make_schedule(seed=7, kinds=kinds, num_groups=3)
    assert a != make_schedule(seed=8, kinds=kinds, num_groups=3)
    assert sorted(f.kind for f in a) == sorted(kinds)
    assert [f.at_s for f in a] == sorted(f.at_s for f in a)
    order = [f.kind for f in a]
    assert order.index(FailureKind.SCALE_UP) == order.index(FailureKind.SCALE_DOWN) + 1
    hang = next(f for f in a if f.kind == FailureKind.HANG)
    assert hang.duration_s > 0


def test_soak_schedule_fills_the_duration():
    s = make_schedule(seed=1, kinds=[FailureKind.KILL_RANK, FailureKind.HANG], num_groups=2, duration_s=300,
                      mtbf_s=10)
    assert len(s) > 10 and s[-1].at_s <= 300 + 100
    assert {f.kind for f in s} == {FailureKind.KILL_RANK, FailureKind.HANG}


def test_bad_schedules_are_refused_naming_the_fix():
    with pytest.raises(ValueError, match="needs at least 3 replica groups.*--groups 3"):
        make_schedule(seed=0, kinds=[FailureKind.KILL_DONOR_IN_HEAL], num_groups=2)
    with pytest.raises(ValueError, match="'kill_node'.*kill_rank"):
        parse_kinds("kill_node")
    with pytest.raises(ValueError, match="positive"):
        make_schedule(seed=0, kinds=[FailureKind.KILL_RANK], num_groups=2, mtbf_s=0)


def _rec(g, t, step, committed=True, quorum=1, participants=2, healed=False, checksum="a", rank=0):
    return dict(replica_group=g, group_rank=rank, time=t, step=step, committed=committed, quorum_id=quorum,
                participants=participants, healed=healed, param_checksum=checksum, loss=1.0)


def _start(g, t, rank=0):
    return dict(replica_group=g, group_rank=rank, event="start", time=t, step=0)


def test_a_clean_run_breaks_nothing():
    ev = [_start(0, 0), _start(1, 0)]
    for s in range(1, 6):
        ev += [_rec(0, s, s, checksum=f"c{s}"), _rec(1, s + 0.01, s, checksum=f"c{s}")]
    assert inv.check_all(ev) == []


def test_repeated_commit_in_one_launch_is_caught_but_not_across_launches():
    ev = [_start(0, 0), _rec(0, 1, 1), _rec(0, 2, 2), _rec(0, 3, 2, checksum="a")]
    assert [v.invariant for v in inv.commits_never_repeat_or_go_back(ev)] == ["monotonic commits"]
    ev = [_start(0, 0), _rec(0, 1, 1), _rec(0, 2, 2), _start(0, 2.5), _rec(0, 3, 2)]
    assert inv.commits_never_repeat_or_go_back(ev) == []


def test_a_group_restarting_from_scratch_loses_steps():
    ev = [_rec(0, t, t, checksum=f"c{t}") for t in range(1, 50)] + [_rec(1, 60, 1, checksum="fresh")]
    v = inv.no_committed_step_lost(ev)
    assert len(v) == 1 and "step 1" in v[0].detail and "step 49" in v[0].detail
    # A replica frozen after its all-reduce commits that same step late, with the same parameters: fine.
    late = [_rec(0, t, t, checksum=f"c{t}") for t in range(1, 50)] + [_rec(1, 60, 10, checksum="c10")]
    assert inv.no_committed_step_lost(late) == []
    assert len(inv.no_committed_step_lost(late[:-1] + [_rec(1, 60, 10, checksum="other")])) == 1
    # A joiner that healed commits right at the frontier: fine.
    assert inv.no_committed_step_lost([_rec(0, t, t) for t in range(1, 50)] + [_rec(1, 60, 50, healed=True)]) == []


def test_a_commit_one_step_behind_must_carry_the_parameters_the_job_had():
    job = [_rec(0, t, t, checksum=f"c{t}") for t in range(1, 50)]
    # A slower group's record of step 48 written after the faster group's 49: same parameters, fine.
    assert inv.no_committed_step_lost(job + [_rec(1, 60, 48, checksum="c48")]) == []
    # One step behind with other parameters: a state the job never held.
    v = inv.no_committed_step_lost(job + [_rec(1, 60, 48, checksum="other")])
    assert len(v) == 1 and "step 48" in v[0].detail and "other" in v[0].detail
    # One step behind with no checksum cannot be told apart from that: refused, not passed.
    v = inv.no_committed_step_lost(job + [_rec(1, 60, 48, checksum=None)])
    assert len(v) == 1 and "no parameter checksum" in v[0].detail
    check = next(c for c in inv.log_checks(job + [_rec(1, 60, 48, checksum="c48")])
                 if c.name == "no committed step lost")
    assert check.held and check.judged == "50 commits, 1 behind the frontier checked by checksum"


def test_different_parameters_after_the_same_commit_are_caught():
    ev = [_rec(0, 1, 5, checksum="x"), _rec(1, 1.01, 5, checksum="y"), _rec(1, 1.02, 6, committed=False,
                                                                             checksum="z")]
    v = inv.replicas_identical_after_commit(ev)
    assert len(v) == 1 and "step 5" in v[0].detail


def test_identical_replicas_refuses_commits_without_a_checksum_and_counts_what_it_compared():
    # Two groups that differ at every step, checksummed only every 100 steps (the library default):
    # the steps without a checksum are not passed as identical.
    ev = [_rec(g, s + g / 100, s, checksum=(f"g{g}s{s}" if s % 100 == 0 else None))
          for s in range(1, 100) for g in (0, 1)]
    check = inv.identical_replicas(ev)
    assert not check.held
    assert [v.detail for v in check.violations] == [
        "198 commits carry no parameter checksum (steps [1, 2, 3, 4, 5] ...): not compared; run with "
        "checksum_every=1 (FTBRIDGE_CHECKSUM_EVERY=1) to judge every commit"]
    assert check.judged.startswith("0 commits compared at 0 steps")
    assert inv.check_all([_rec(0, 1, 1, checksum=None), _rec(1, 1, 1, checksum=None)])
    # Every commit checksummed and equal: held, and it says how much it saw.
    ok = [_rec(g, s + g / 100, s, checksum=f"c{s}") for s in range(1, 11) for g in (0, 1)] + [_rec(0, 20, 11)]
    check = inv.identical_replicas(ok)
    assert check.held and check.judged == ("20 commits compared at 10 steps, 1 alone at their step, "
                                           "0 orphan commits left out")
    assert str(check).startswith("replicas identical after every commit: held (20 commits")


def test_recovery_measures_survivors_and_the_rejoin():
    ev = [_rec(0, 9.9, 10, quorum=1), _rec(1, 9.9, 10, quorum=1),
          _rec(0, 10.5, 11, committed=False, quorum=1),          # all-reduce with the dead peer failed
          _rec(0, 11.0, 11, quorum=1),                            # old quorum: a step already under way
          _rec(0, 13.0, 12, quorum=2, participants=1),            # new quorum without group 1
          _rec(1, 30.0, 40, quorum=3, healed=True)]
    r = inv.recovery(ev, t_inject=10.0, hit=[1])
    assert r.survivors_s == pytest.approx(3.0) and r.rejoin_s == pytest.approx(20.0) and r.discarded == 1


def test_hung_group_that_nobody_left_behind_rejoins_without_a_heal():
    # Everyone waited the hang out and discarded together: the hung group kept the same state, so its
    # first commit with the others is its rejoin; a failure that needs a heal does not count that.
    ev = [_rec(0, 9.9, 10, quorum=1, participants=2), _rec(1, 9.9, 10, quorum=1, participants=2),
          _rec(0, 18.0, 10, committed=False, quorum=1, participants=2),
          _rec(1, 18.0, 10, committed=False, quorum=1, participants=2),
          _rec(0, 18.2, 11, quorum=2, participants=2), _rec(1, 18.2, 11, quorum=2, participants=2)]
    assert inv.recovery(ev, t_inject=10.0, hit=[1], heal_optional=True).rejoin_s == pytest.approx(8.2)
    assert inv.recovery(ev, t_inject=10.0, hit=[1]).rejoin_s is None


def test_orphan_commit_of_a_group_that_died_is_reported_not_a_divergence():
    # Quorum 5 = groups 0, 1, 2; group 1 dies mid all-reduce: group 2's ring finished (commit, "b"),
    # group 0's failed (discard). Group 2 dies before its next step; 0 commits step 11 later ("c").
    ev = [_rec(0, 10.0, 11, committed=False, quorum=5, participants=3, checksum="a"),
          _rec(2, 10.0, 11, quorum=5, participants=3, checksum="b"), _start(2, 20.0),
          _rec(0, 22.0, 11, quorum=7, participants=1, checksum="c"),
          _rec(2, 25.0, 12, quorum=8, participants=2, healed=True, checksum="d"),
          _rec(0, 25.0, 12, quorum=8, participants=2, checksum="d")]
    assert [(e["replica_group"], e["step"]) for e in inv.orphan_commits(ev)] == [(2, 11)]
    assert inv.replicas_identical_after_commit(ev) == []
    # Had group 2 lived (no restart), its commit is no orphan and the divergence is reported.
    alive = [e for e in ev if e.get("event") != "start"]
    assert inv.orphan_commits(alive) == [] and inv.replicas_identical_after_commit(alive)


def test_final_loss_tolerance():
    assert inv.final_loss_close(2.0, 2.05, 0.1) == []
    assert inv.final_loss_close(2.0, 2.5, 0.1)[0].invariant == "final loss"
    assert inv.final_loss_close(None, 2.5, 0.1)


def test_the_final_loss_is_the_jobs_at_its_last_step_not_a_left_groups_earlier_one():
    from ftbridge.harness.chaos import verdict

    final = [{"event": "final", "step": 7283, "val_loss": 1.80} for _ in range(4)]
    left = [{"event": "final", "step": 964, "val_loss": 2.07}, {"event": "final", "step": 4313, "val_loss": 1.87}]
    assert verdict.final_loss(final + left) == pytest.approx(1.80)
    assert verdict.final_loss(left) == pytest.approx(1.87)
    assert verdict.final_loss([{"event": "start"}]) is None


def test_with_slots_the_final_loss_is_held_to_the_same_model_not_the_loose_tolerance():
    from ftbridge.harness.chaos.runner import ChaosSettings

    name, tolerance = ChaosSettings(workdir="unused", slots=3).loss_check
    assert (name, tolerance) == ("same model as the failure-free run", 1e-3)
    assert inv.final_loss_close(1.8048172, 1.8048179, tolerance) == []
    assert "differs by 0.08" in str(inv.final_loss_close(1.8856, 1.8048, tolerance)[0])
    assert ChaosSettings(workdir="unused").loss_check == ("final loss within tolerance", 0.15)


def _result(events, checks, violations=None, baseline_loss=None):
    from ftbridge.harness.chaos.runner import ChaosResult, ChaosSettings

    violations = [str(v) for c in checks for v in c.violations] if violations is None else violations
    return ChaosResult(ChaosSettings(workdir="unused", baseline=baseline_loss is not None), [], [], events,
                       violations, 5, 1.9, baseline_loss, [], 12.0, checks)


def test_the_report_lists_only_the_checks_that_ran_with_their_outcome():
    from ftbridge.harness.chaos import report

    ev = [_rec(g, s + g / 100, s, checksum=f"c{s}") for s in range(1, 6) for g in (0, 1)]
    text = report.table(_result(ev, inv.log_checks(ev)))
    assert "OK: 4 of 4 checks held" in text
    assert "held   replicas identical after every commit (10 commits compared at 5 steps" in text
    assert "not run: final loss against a failure-free run (--no-baseline)" in text
    assert "every invariant held" not in text and "within tolerance" not in text
    # Groups that differ, logged without checksums: the run is not ok and the report says so.
    bad = [_rec(g, s + g / 100, s, checksum=None) for s in range(1, 6) for g in (0, 1)]
    result = _result(bad, inv.log_checks(bad))
    text = report.table(result)
    assert not result.ok and "FAILED: 3 of 4 checks held" in text
    assert "BROKEN replicas identical after every commit (0 commits compared" in text
    assert "10 commits carry no parameter checksum" in text and "every invariant held" not in text
    summary = report.summary(result)
    assert [c["held"] for c in summary["checks"]] == [True, True, False, True]
    # A violation outside the listed checks is shown too, and the loss check shows when it ran.
    loss = inv.Check("final loss within tolerance", "1.9 against failure-free 1.8, tolerance 0.15",
                     inv.final_loss_close(1.9, 1.8, 0.15))
    text = report.table(_result(ev, [loss], violations=["something else"], baseline_loss=1.8))
    assert "FAILED: 1 of 1 checks held" in text and "BROKEN something else" in text and "not run" not in text
    same = inv.Check("same model as the failure-free run", "1.7877 against failure-free 1.7877, tolerance 0.001", [])
    assert "not run" not in report.table(_result(ev, [same], baseline_loss=1.7877))


def test_outage_pause_counts_the_longest_gap_in_steps_and_the_report_shows_it():
    from ftbridge.harness.chaos import report
    from ftbridge.harness.chaos.inject import Injected
    from ftbridge.harness.chaos.runner import Outcome
    from ftbridge.harness.chaos.schedule import Failure

    def recs(times):
        return [dict(time=t, committed=True, step_time_s=0.1) for t in times]

    before = [9.0 + 0.1 * i for i in range(10)]  # commits every 0.1 s up to 9.9
    rode = inv.outage_pause(recs(before + [10.0 + 0.1 * i for i in range(100)] + [20.0]), 10.0, 20.0)
    assert rode.committed == 100 and rode.pause_s == pytest.approx(0.1) and rode.steps_lost == pytest.approx(0.0)
    waited = inv.outage_pause(recs(before + [10.0, 20.3]), 10.0, 20.0)  # the step in flight, then 10.3 s
    assert waited.committed == 1 and waited.pause_s == pytest.approx(10.3)
    assert waited.steps_lost == pytest.approx(102.0) and waited.reference_s == pytest.approx(0.1)
    assert inv.outage_pause(recs(before), 10.0, 20.0) is None  # nothing after the outage: not judged
    # Rode it out, then stalled 2.5 s on the way back after the first commit past it: only settle_s sees it.
    back = recs(before + [10.0 + 0.1 * i for i in range(100)] + [20.0, 22.5, 22.6, 23.5])
    assert inv.outage_pause(back, 10.0, 20.0).pause_s == pytest.approx(0.1)
    settled = inv.outage_pause(back, 10.0, 20.0, settle_s=3.0)
    assert settled.pause_s == pytest.approx(2.5) and settled.committed == 100
    assert inv.outage_pause(back, 10.0, 20.0, settle_s=3.0 + 0.7) is None  # nothing after the settling time
    result = _result([], [])
    failure = Failure(0, FailureKind.LIGHTHOUSE_OUTAGE, 1.0, duration_s=10.0)
    result.outcomes.append(Outcome(Injected(failure, 10.0, [], [], "down", ended=20.0), True, None, [], waited))
    assert "steps lost 102.0 / 102.0 / 102.0, longest pause between commits 10.3 / 10.3 / 10.3 s" in \
        report.table(result)


# -- warm spares in the mix (ftbridge.harness.chaos.spares) ---------------------------------------

def test_spare_count_is_validated_before_anything_starts():
    from ftbridge.harness.chaos.cli import parse_args
    from ftbridge.harness.chaos.spares import validate_spares

    validate_spares(0, 3)
    validate_spares(3, 3)
    with pytest.raises(ValueError, match="--spares -1: must be 0"):
        validate_spares(-1, 3)
    with pytest.raises(ValueError, match="--spares 4 with --groups 3.*use --spares 3 or fewer"):
        validate_spares(4, 3)
    assert parse_args(["--spares", "2"]).spares == 2
    with pytest.raises(SystemExit) as exc:
        parse_args(["--spares", "-2"])
    assert exc.value.code == 2


@pytest.mark.parametrize("argv, message", [
    (["--count", "0"], "argument --count: 0 is below the smallest allowed value, 1"),
    (["--kinds", "kill_group,explode"], "failure kind 'explode': choose from kill_rank"),
    (["--mtbf", "nan"], "argument --mtbf: nan is not a finite number"),
    (["--outage-s", "-3"], "argument --outage-s: -3.0 must be above 0"),
    (["--hang-s", "inf"], "argument --hang-s: inf is not a finite number"),
    (["--soak-minutes", "0"], "argument --soak-minutes: 0.0 must be above 0"),
])
def test_bad_count_or_kind_is_a_usage_error_before_anything_starts(argv, message, capsys):
    from ftbridge.harness.chaos.cli import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_chaos_trains_with_a_slot_per_group_unless_told_otherwise():
    from ftbridge.harness.chaos.cli import parse_args

    assert parse_args(["--groups", "3"]).slots == 3
    assert parse_args(["--groups", "3", "--slots", "0"]).slots == 0
    assert parse_args(["--groups", "2", "--slots", "4"]).slots == 4


def test_ranks_and_timeout_take_ftbridge_runs_spelling_and_the_old_one():
    from ftbridge.harness.chaos.cli import parse_args

    new = parse_args(["--nproc-per-node", "3", "--cross-replica-timeout-s", "7"])
    old = parse_args(["--nproc", "3", "--cross-replica-timeout", "7"])
    assert (new.nproc, new.cross_replica_timeout) == (old.nproc, old.cross_replica_timeout) == (3, 7.0)


def test_targets_are_the_processes_holding_a_group_id_not_the_standing_by_spares():
    from ftbridge.harness.chaos import spares

    ev = [dict(_start(1, 0.0, rank=r), pid=100 + r) for r in (0, 1)]           # group 1's own launch
    ev += [dict(_start(0, 0.0, rank=r), pid=10 + r) for r in (0, 1)]
    ev += [dict(_start(1, 9.0, rank=r), pid=200 + r) for r in (0, 1)]          # spare 0 took id 1 at t=9
    held = spares.holders(ev, [0, 1, 2])
    assert held == {0: {0: 10, 1: 11}, 1: {0: 200, 1: 201}, 2: {}}
    # Group 1's restart (pids 500, 501) joined while the spare was paused, met it in a quorum and left:
    # the spare, whose start is older, still holds id 1.
    left = ev + [dict(_start(1, 20.0, rank=r), pid=500 + r) for r in (0, 1)]
    assert spares.holders(left, [1], running=lambda pid, t: pid < 500) == {1: {0: 200, 1: 201}}
    ready = [dict(event="spare_ready", time=1.0, pid=200 + r, replica_group=3, group_rank=r) for r in (0, 1)]
    ready += [dict(event="spare_ready", time=12.0, pid=300 + r, replica_group=7, group_rank=r) for r in (0, 1)]
    held_pids = {p for ranks in held.values() for p in ranks.values()}
    assert spares.standing_by(ready, held_pids) == [300, 301]  # the demoted restart of group 1 stands by
    assert spares.spare_ids(3, 1) == [3, 6, 7, 8]  # spare 0 -> id 3; demoted group G -> index 3 + G -> id 6 + G


def test_local_job_reads_the_current_holder_and_every_stand_by_log(tmp_path):
    import json
    import os

    from ftbridge.harness.local_job import LocalJob

    job = LocalJob(str(tmp_path), num_groups=2, nproc_per_node=1, script_args=[])
    me = os.getpid()
    with open(job.event_log(1, 0), "w") as f:  # group 1: its own launch, then a spare (this process) took over
        f.write(json.dumps(dict(_start(1, 1.0), pid=999_999)) + "\n")
        f.write(json.dumps(dict(_start(1, 2e9), pid=me)) + "\n")
    with open(job.event_log(2 * 2 + 1, 0), "w") as f:  # group 1's restart, demoted to spare 2 + 1 -> id 5
        f.write(json.dumps(dict(event="spare_ready", time=3.0, pid=4242, replica_group=5, group_rank=0)) + "\n")
    assert job.worker_pids(1) == {0: me}
    assert job.holding_pids(1) == [me]
    assert set(job.all_worker_pids()) == {999_999, me, 4242}
    with open(job.event_log(0, 0), "w") as f:  # group 0: its launch (the parent) and a spare (this process)
        f.write(json.dumps(dict(_start(0, 2e9), pid=os.getppid())) + "\n")
        f.write(json.dumps(dict(_start(0, 2e9 + 1), pid=me)) + "\n")
    assert job.holding_pids(0) == [os.getppid(), me] and job.worker_pids(0) == {0: me}
    assert job.launch_of(me) is None  # no launch of this job runs it


def test_with_spares_scale_down_is_skipped_with_its_reason_and_the_report_counts_takeovers():
    from ftbridge.harness.chaos import report
    from ftbridge.harness.chaos.inject import Injector
    from ftbridge.harness.chaos.runner import ChaosResult, ChaosSettings, Outcome
    from ftbridge.harness.chaos.schedule import Failure
    from ftbridge.harness.chaos.spares import SCALE_DOWN_WITH_SPARES

    inj = Injector(job=None, alive={0, 1, 2}, fault_dir="unused", seed=0, spares=1).inject(
        Failure(0, FailureKind.SCALE_DOWN, 1.0))
    assert inj.skipped == SCALE_DOWN_WITH_SPARES
    ev = [_rec(g, s + g / 100, s, checksum=f"c{s}") for s in range(1, 6) for g in (0, 1)]
    ev += [dict(event="spare_join", time=3.5, replica_group=1, group_rank=r, replaces=1) for r in (0, 1)]
    result = ChaosResult(ChaosSettings(workdir="unused", spares=1, baseline=False), [], [Outcome(inj, True)], ev,
                         [], 5, 1.9, None, [], 12.0, inv.log_checks(ev), spare_pids=[300, 301])
    text = report.table(result)
    assert "warm spares: 1 started, 1 takeovers (spare_join), 2 standing-by ranks stopped at the end" in text
    assert "skipped: failure 0 (scale_down): warm spares run" in text
    assert "0 failures injected (1 skipped) in 12 s (the failure-free run not included)" in text
    summary = report.summary(result)
    assert (summary["spares_started"], summary["takeovers"], summary["standing_by_stopped"]) == (1, 1, [300, 301])


@pytest.mark.parametrize("kind", [FailureKind.KILL_GROUP, FailureKind.KILL_RANK, FailureKind.HANG,
                                  FailureKind.KILL_JOINER_IN_HEAL, FailureKind.SLOW_GROUP])
def test_a_failure_drawn_on_a_group_whose_ranks_are_still_restarting_is_skipped_with_its_reason(kind):
    # A kill_in_checkpoint killed group 0, and the next failure drew group 0 while its restart (and the spare
    # taking its id) had no rank running yet: the failure is skipped, the run goes on.
    from types import SimpleNamespace

    from ftbridge.harness.chaos.inject import Injector
    from ftbridge.harness.chaos.schedule import Failure

    job = SimpleNamespace(worker_pids=lambda g: {}, holding_pids=lambda g, r=0: [])
    inj = Injector(job=job, alive={0, 1, 2}, fault_dir="unused", seed=0).inject(Failure(3, kind, 1.0))
    assert inj.skipped.startswith("group ") and "has no running ranks yet" in inj.skipped


def test_a_kill_of_one_of_two_processes_holding_a_group_is_judged_as_a_hang():
    # A spare took group 1's id while group 1 was cut off from the lighthouse; both still run. The kill hits
    # the newer holder, and the older one may go on as group 1 with no heal: recovery is "heal or commit with
    # the others again", as after a hang.
    import os
    import signal
    import subprocess
    from types import SimpleNamespace

    from ftbridge.harness.chaos.inject import Injector
    from ftbridge.harness.chaos.schedule import Failure

    victims = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    try:
        for shared in (False, True):
            victim = victims[shared]
            job = SimpleNamespace(worker_pids=lambda g, v=victim: {0: v.pid}, event_log=lambda g, r: "/nonexistent",
                                  holding_pids=lambda g, v=victim, s=shared: [os.getpid(), v.pid] if s else [v.pid],
                                  wait_until=lambda cond, t, what, v=victim: (v.wait(timeout=t), cond()))
            inj = Injector(job=job, alive={0, 1}, fault_dir="unused", seed=0).inject(
                Failure(0, FailureKind.KILL_RANK, 1.0))
            assert victim.poll() == -signal.SIGKILL  # really killed
            assert inj.heal_optional is shared
            assert inj.target.endswith(", one of 2 processes holding the group's id") is shared
    finally:
        for v in victims:
            v.kill()
            v.wait(timeout=10)


def test_a_paused_groups_late_commit_after_the_spares_start_is_its_own_launch():
    # Group 1 froze in step 3 (pid 100); a spare (pid 200) took its id, healed and committed 4 and 5;
    # the resumed pid 100 commits step 3 late, in the same log, then leaves.
    ev = [dict(_start(1, 0.0), pid=100), dict(_rec(1, 1, 2, checksum="c2"), pid=100),
          dict(_start(1, 2.0), pid=200), dict(_rec(1, 3, 4, checksum="c4"), pid=200),
          dict(_rec(1, 4, 5, checksum="c5"), pid=200), dict(_rec(1, 4.5, 3, checksum="c3"), pid=100)]
    assert inv.commits_never_repeat_or_go_back(ev) == []
    ev.append(dict(_rec(1, 5, 4, checksum="c4"), pid=200))  # the spare itself going back is still caught
    assert [v.invariant for v in inv.commits_never_repeat_or_go_back(ev)] == ["monotonic commits"]


def test_a_rank_burning_cpu_without_stepping_is_a_spin_and_a_stepping_or_idle_one_is_not():
    events = [{**_rec(0, 10.5, 5), "pid": 100}, {**_rec(1, 10.6, 5, committed=False), "pid": 200}]
    used = {100: 9.0, 200: 9.0, 300: 9.0, 400: 1.0}  # 10 s window: 300 stepped never, at 90 % of a core
    spins = inv.spinning_ranks(used, events, 10.0, 20.0)
    assert [str(v) for v in spins] == ["no rank spins: pid 300 used 9.0 s of CPU in 10.0 s without writing a "
                                       "step record"]
    assert inv.spinning_ranks(used, events, 12.0, 22.0)[0].detail.startswith("pid 100")  # its record is outside
    assert inv.spinning_ranks({}, events, 10.0, 20.0) == []


@pytest.mark.timeout(60)
def test_half_speed_stops_a_process_in_turns_and_leaves_it_running():
    import subprocess
    import threading

    from ftbridge.harness.chaos.inject import half_speed

    proc = subprocess.Popen(["sleep", "30"])
    states, done = set(), threading.Event()

    def watch():  # the process's state while half_speed runs (bounded by the test's timeout)
        while not done.is_set():
            with open(f"/proc/{proc.pid}/stat", encoding="ascii") as f:
                states.add(f.read().rsplit(")", 1)[1].split()[0])

    t = threading.Thread(target=watch)
    t.start()
    try:
        half_speed([proc.pid], 0.5)
        done.set()
        t.join(10)
        with open(f"/proc/{proc.pid}/stat", encoding="ascii") as f:
            after = f.read().rsplit(")", 1)[1].split()[0]
        assert "T" in states and after != "T", (states, after)
    finally:
        done.set()
        proc.kill()
        proc.wait(10)


def test_every_failure_kind_has_a_colour_in_the_plot():
    from ftbridge.harness.chaos.report import _COLORS

    assert set(_COLORS) == set(FailureKind)


def test_a_kind_needing_hosts_of_their_own_is_refused_with_spares_or_without_root_and_left_out_of_all(monkeypatch):
    from ftbridge.harness import netns
    from ftbridge.harness.chaos.cli import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--kinds", "partition_peer", "--spares", "1"])
    assert FailureKind.PARTITION_PEER not in parse_args(["--spares", "1"]).kind_list
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert netns.available() == "network namespaces need root"
    assert FailureKind.PARTITION_PEER not in parse_args([]).kind_list
    with pytest.raises(SystemExit):
        parse_args(["--kinds", "partition_peer,kill_rank"])


def test_with_slots_every_groups_final_parameters_are_held_to_the_failure_free_runs(tmp_path):
    import torch
    from safetensors.torch import save_file

    from ftbridge.harness.chaos.verdict import same_parameters

    ours, base = tmp_path / "ours", tmp_path / "base"
    ours.mkdir()
    base.mkdir()
    w = torch.linspace(-1, 1, 100)

    def save(folder, name, tensor, step):
        save_file({"w": tensor.contiguous(), "b": torch.ones(3)}, str(folder / name),
                  metadata={"global_steps": str(step)})

    save(base, "group0.st", w, 50)
    save(ours, "group0.st", w + 1e-6, 50)
    save(ours, "group1.st", w, 50)
    save(ours, "group2.st", w * 3, 20)  # left at step 20 (a scale-down): not compared
    (ours / "group3.st").write_bytes(b"12345")  # killed while writing: not compared
    check = same_parameters(str(ours), str(base), 50, 1e-3)
    assert check.held and check.judged.startswith("2 groups at step 50"), check
    save(ours, "group1.st", w * 1.01, 50)  # 1 % off: a lost unit, a wrong divisor
    check = same_parameters(str(ours), str(base), 50, 1e-3)
    assert not check.held and "group1.st" in str(check.violations[0]) and "1.00e-02" in str(check.violations[0])
    missing = same_parameters(str(ours), str(base), 60, 1e-3)
    assert not missing.held and "no parameters saved at step 60" in str(missing.violations[0])


def test_a_launch_that_outlives_the_job_is_a_broken_check_not_a_crash():
    from ftbridge.harness.chaos.runner import _wait_launches

    class Proc:
        def __init__(self, code):
            self.code = code

        def poll(self):
            return self.code

    class Launch:
        def __init__(self, code, path):
            self.proc, self.log_path = Proc(code), path

    class Job:
        def wait_until(self, condition, timeout_s, what):
            if not condition():
                raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")

    check = _wait_launches(Job(), {0: Launch(0, "g0.log"), 2: Launch(None, "g2.log")}, 1.0)
    assert check.name == "every launch ends with the job" and check.judged == "2 launches waited for"
    assert [v.detail for v in check.violations] == [
        "the launch holding replica group 2 (g2.log) still ran 1 s after the job's stop (its log tells why)"]


def _commits(path, steps):
    import json

    with open(path, "w") as f:
        f.write(json.dumps({"event": "start", "time": 0.0}) + "\n")
        for step in steps:
            f.write(json.dumps({"step": step, "committed": True, "time": float(step)}) + "\n")
        f.write(json.dumps({"step": steps[-1] + 1, "committed": False, "time": 99.0}) + "\n")
        f.write('{"step": 7, "commi')  # a torn last line (a process killed mid-write)


def test_newest_commit_reads_the_last_committed_step_of_an_event_log(tmp_path):
    from ftbridge.harness.chaos.inject import newest_commit

    _commits(tmp_path / "e.jsonl", [3, 4, 5])
    assert newest_commit(str(tmp_path / "e.jsonl")) == 5
    assert newest_commit(str(tmp_path / "missing.jsonl")) == -1


@pytest.mark.parametrize("kind", [FailureKind.KILL_GROUP, FailureKind.KILL_RANK, FailureKind.KILL_DONOR_IN_HEAL,
                                  FailureKind.KILL_IN_CHECKPOINT])
def test_a_kill_that_would_take_the_last_holder_of_the_newest_steps_is_skipped(tmp_path, monkeypatch, kind):
    """Soak seed 72: groups 0 and 2 committed 105 steps group 1 missed, then both were killed; no replica held
    those steps any more. That double fault is beyond what in-memory replicas survive: the kill is skipped."""
    from types import SimpleNamespace

    from ftbridge.harness.chaos import inject
    from ftbridge.harness.chaos.schedule import Failure

    monkeypatch.setattr(inject, "HOLDER_WAIT_S", 0.2)
    killed = []
    job = SimpleNamespace(worker_pids=lambda g: {0: 10 + g}, holding_pids=lambda g, r=0: [10 + g],
                          event_log=lambda g, r: str(tmp_path / f"events_{g}_{r}.jsonl"),
                          kill_workers=lambda g, timeout_s: killed.append(g) or [10 + g])
    _commits(tmp_path / "events_0_0.jsonl", list(range(100, 206)))  # the only holder of steps 101-205
    _commits(tmp_path / "events_1_0.jsonl", list(range(90, 101)))
    _commits(tmp_path / "events_2_0.jsonl", list(range(90, 101)))
    monkeypatch.setattr(inject.random.Random, "choice", lambda self, seq: 0 if 0 in seq else seq[0])
    inj = inject.Injector(job=job, alive={0, 1, 2}, fault_dir=str(tmp_path), seed=0).inject(Failure(3, kind, 1.0))
    assert "newest committed step 205" in inj.skipped and not killed, inj


def test_a_kill_goes_ahead_while_another_group_holds_the_newest_step(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from ftbridge.harness.chaos import inject
    from ftbridge.harness.chaos.schedule import Failure

    killed = []
    job = SimpleNamespace(worker_pids=lambda g: {0: 10 + g}, holding_pids=lambda g, r=0: [10 + g],
                          event_log=lambda g, r: str(tmp_path / f"events_{g}_{r}.jsonl"),
                          kill_workers=lambda g, timeout_s: killed.append(g) or [10 + g])
    for g, last in ((0, 205), (1, 205), (2, 100)):
        _commits(tmp_path / f"events_{g}_0.jsonl", list(range(90, last + 1)))
    monkeypatch.setattr(inject.random.Random, "choice", lambda self, seq: 0 if 0 in seq else seq[0])
    inj = inject.Injector(job=job, alive={0, 1, 2}, fault_dir=str(tmp_path), seed=0).inject(
        Failure(3, FailureKind.KILL_GROUP, 1.0))
    assert not inj.skipped and killed == [0]


@pytest.mark.parametrize("behind", [False, True], ids=["together", "one-behind"])
def test_a_donor_kill_is_armed_only_once_the_other_groups_commit_together_again(tmp_path, monkeypatch, behind):
    """A CI dry run: the first kill left group 2 a step behind group 1; armed at once, the donor's point fired
    in group 1 as it healed group 2, and with it went the only holder of the newest step."""
    from types import SimpleNamespace

    from ftbridge.harness.chaos import inject

    monkeypatch.setattr(inject, "DONOR_SYNC_S", 0.3)
    monkeypatch.setattr(inject, "HOLDER_WAIT_S", 0.2)
    for g in (0, 1, 2):
        _commits(tmp_path / f"events_{g}_0.jsonl", list(range(90, 101 if g == 2 and behind else 102)))
    steps = {1: [{"committed": True, "time": 101.0, "participants": 2}],
             2: [{"committed": not behind, "time": 101.0, "participants": 2}]}
    def wait_until(condition, timeout_s, what):  # LocalJob.wait_until's contract, without the log tails
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
            time.sleep(0.05)  # polling files written by other processes, as LocalJob does

    job = SimpleNamespace(event_log=lambda g, r: str(tmp_path / f"events_{g}_{r}.jsonl"),
                          steps=lambda g: steps[g], healed_since=lambda g, t: False, wait_until=wait_until)
    injector = inject.Injector(job=job, alive={0, 1, 2}, fault_dir=str(tmp_path / "faults"), seed=0)
    why = injector._arm_donor(0, 100.5)
    armed = (tmp_path / "faults" / "heal_send").exists()
    assert (bool(why), armed) == ((True, False) if behind else (False, True)), why
