"""Pure functions of the failover, heal, restart and rescale benchmarks, on synthetic event lists."""

from __future__ import annotations

import pytest

from ftbridge.harness.bench.core import BenchSettings
from ftbridge.harness.bench.failover import committed_steps_lost, count_metric, killed_group_steps_lost, survivor_stall
from ftbridge.harness.bench.failure_jobs import check_recovered
from ftbridge.harness.bench.heal import PHASES, heal_phases, loopback_seconds
from ftbridge.harness.bench.restart import ftbridge_resume, plain_resume


def rec(t, step, committed=True, participants=2, group=0, rank=0, step_time_s=0.1, **kw):
    return dict(time=t, step=step, committed=committed, participants=participants, replica_group=group,
                group_rank=rank, healed=False, step_time_s=step_time_s, **kw)


def test_committed_steps_lost_counts_repeated_steps():
    assert committed_steps_lost([rec(1, 1), rec(2, 2), rec(3, 3)]) == 0
    assert committed_steps_lost([rec(1, 5), rec(2, 6), rec(3, 7), rec(4, 5)]) == 3  # 5, 6, 7 done twice
    assert committed_steps_lost([rec(1, 5), rec(2, 5)]) == 1
    # Discarded steps never count; order is by time, not list order.
    assert committed_steps_lost([rec(3, 7), rec(1, 5), rec(2, 6, committed=False)]) == 0


def test_killed_group_steps_lost_compares_its_commits_with_the_step_it_resumed_from():
    before = [rec(1, 1, group=1), rec(2, 2, group=1), rec(3, 3, group=1), rec(3, 3)]
    # Healed from the survivor (which went on to step 6): it resumes past its own step 3.
    assert killed_group_steps_lost(before + [rec(9, 7, group=1)], kill_time=3.5) == 0
    # Healed to exactly where it was: nothing lost either.
    assert killed_group_steps_lost(before + [rec(9, 4, group=1)], kill_time=3.5) == 0
    # Restarted from scratch (no peer to heal from): its first commit is step 1, all 3 steps lost,
    # although the survivor's step counter never went back.
    assert killed_group_steps_lost(before + [rec(9, 1, group=1)], kill_time=3.5) == 3
    assert committed_steps_lost([rec(3, 3), rec(4, 4), rec(5, 5)]) == 0
    # Resumed one step behind what it had committed.
    assert killed_group_steps_lost(before + [rec(9, 3, group=1)], kill_time=3.5) == 1
    with pytest.raises(ValueError, match="0 after the kill"):
        killed_group_steps_lost(before, kill_time=3.5)


def _final(g, r, step=9, params="p", opt="o"):
    return {"event": "final", "time": 10.0 + g, "replica_group": g, "group_rank": r, "step": step,
            "param_checksum": params, "optimizer_checksum": opt}


def test_check_recovered_refuses_a_crash_or_a_divergence_after_recovery():
    ok = [_final(0, 0), _final(1, 0)]
    check_recovered(ok, {0: 0, 1: 0}, groups=(0, 1), ranks=1, what="run")
    with pytest.raises(RuntimeError, match="replica group 1 exited 1"):
        check_recovered(ok, {0: 0, 1: 1}, groups=(0, 1), ranks=1, what="run")
    with pytest.raises(RuntimeError, match="final parameters differ"):
        check_recovered([_final(0, 0), _final(1, 0, params="q")], {0: 0, 1: 0}, groups=(0, 1), ranks=1, what="run")
    with pytest.raises(RuntimeError, match="final steps differ"):
        check_recovered([_final(0, 0), _final(1, 0, step=8)], {0: 0, 1: 0}, groups=(0, 1), ranks=1, what="run")
    with pytest.raises(RuntimeError, match="optimizer state differs"):
        check_recovered([_final(0, 0), _final(1, 0, opt="x")], {0: 0, 1: 0}, groups=(0, 1), ranks=1, what="run")
    with pytest.raises(RuntimeError, match=r"no final record from \(group, rank\) \[\(1, 0\)\]"):
        check_recovered([_final(0, 0)], {0: 0, 1: 0}, groups=(0, 1), ranks=1, what="run")
    # Only a rank's last launch counts: a first launch that diverged and was healed afterwards is fine.
    healed = [{**_final(1, 0, params="old"), "time": 1.0}] + ok
    check_recovered(healed, {0: 0, 1: 0}, groups=(0, 1), ranks=1, what="run")


def test_survivor_stall_ends_at_first_commit_without_the_dead_group():
    records = [rec(1.0, 1, step_time_s=0.5), rec(1.1, 2), rec(1.2, 3),
               rec(1.25, 4),                          # in flight at the kill, commits with the old quorum
               rec(2.0, 4, committed=False),           # all-reduce with the dead peer failed
               rec(3.3, 5, participants=1), rec(3.4, 6, participants=1)]
    s = survivor_stall(records, kill_time=1.22)
    assert s["stall_s"] == pytest.approx(3.3 - 1.22)
    assert s["discarded"] == 1
    assert s["lost"] == 0
    assert s["step_time_s"] == pytest.approx(0.1)  # first (warm-up) step dropped


def test_with_slots_the_survivors_step_counts_the_units_it_computes_after_the_kill():
    full, alone = [[0, 0]], [[0, 0], [1, 0]]  # a group's own unit; then the dead group's too
    records = [rec(1.0, 1, units=full), rec(1.1, 2, units=full), rec(1.2, 3, units=full),
               rec(3.3, 4, participants=1, units=alone)]
    assert survivor_stall(records, kill_time=1.22)["step_time_s"] == pytest.approx(0.2)
    assert survivor_stall([{k: v for k, v in r.items() if k != "units"} for r in records],
                          kill_time=1.22)["step_time_s"] == pytest.approx(0.1), "without slots: one step"


def test_survivor_stall_raises_without_records():
    with pytest.raises(ValueError, match="before the kill"):
        survivor_stall([rec(5, 1)], kill_time=1)
    with pytest.raises(ValueError, match="no commit without the killed group"):
        survivor_stall([rec(1, 1), rec(2, 2)], kill_time=1.5)


def test_count_metric_target_holds_only_if_every_rep_meets_it():
    assert count_metric("x", [0, 0, 2], 1).met is False
    assert count_metric("x", [0, 1, 1], 1).met is True
    assert count_metric("x", [3], None).met is None


def restarted_group_events(kill=10.0):
    ident = {"replica_group": 1, "group_rank": 0}
    return [{**ident, **e} for e in [
        {"event": "phase", "name": "process_start", "time": 2.0},  # the first launch: ignored
        rec(9.0, 5, group=1),
        {"event": "phase", "name": "process_start", "time": kill + 1.0},
        {"event": "phase", "name": "imports_done", "time": kill + 3.0},
        rec(kill + 6.0, 0, committed=False, group=1, step_time_s=1.0),  # a step waiting for the quorum
        {"event": "heal_transfer", "bytes": 4_000_000, "start": kill + 6.5, "fetched": kill + 6.6,
         "time": kill + 6.7},
        rec(kill + 7.0, 9, group=1, step_time_s=0.4),
    ]]


def test_heal_phases_tile_kill_to_first_commit():
    h = heal_phases(restarted_group_events(), kill_time=10.0)
    assert list(h["phases"]) == list(PHASES)
    assert h["phases"]["torchrun restart"] == pytest.approx(1.0)
    assert h["phases"]["process start"] == pytest.approx(2.0)
    assert h["phases"]["DeepSpeed init"] == pytest.approx(2.0)  # to the first step's begin (16 - 1)
    assert h["phases"]["quorum"] == pytest.approx(1.5)
    assert h["phases"]["state transfer"] == pytest.approx(0.2)
    assert h["phases"]["first commit"] == pytest.approx(0.3)
    assert sum(h["phases"].values()) == pytest.approx(h["total_s"]) == pytest.approx(7.0)
    assert h["bytes"] == 4_000_000 and h["transfer_s"] == pytest.approx(0.2)


def test_heal_phases_raise_on_a_missing_boundary():
    events = [e for e in restarted_group_events() if e.get("event") != "heal_transfer"]
    with pytest.raises(ValueError, match="heal_transfer"):
        heal_phases(events, kill_time=10.0)


def test_loopback_baseline_sends_all_bytes():
    assert loopback_seconds(3_000_000) > 0


def test_plain_resume_counts_steps_since_the_checkpoint():
    events = [rec(1, 1), rec(2, 2), rec(3, 3),  # checkpoint at 2 (below), killed after 3
              {"event": "checkpoint_saved", "time": 2.01, "step": 2},
              {"event": "checkpoint_loaded", "time": 8.0, "step": 2}, rec(9.0, 3)]
    r = plain_resume(events, kill_time=3.5)
    assert r == {"resume_s": pytest.approx(5.5), "lost": 1.0}
    # Without a checkpoint the restart starts from step 0.
    assert plain_resume([rec(1, 1), rec(2, 2), rec(9, 1)], kill_time=3)["lost"] == 2.0


def test_ftbridge_resume_survivors_and_rejoined_group():
    events = [rec(1.0, 1), rec(1.0, 1, group=1), rec(2.0, 2), rec(2.0, 2, group=1),
              rec(4.5, 3, participants=1), rec(5.0, 4, participants=1),
              rec(9.0, 5, group=1), rec(9.0, 5)]
    r = ftbridge_resume(events, kill_time=2.5)
    assert r["survivors_s"] == pytest.approx(2.0)
    assert r["rejoined_s"] == pytest.approx(6.5)
    assert r["lost"] == 0 and r["committed_lost"] == 0
    # The killed group came back from scratch (step 1): its 2 committed steps are lost.
    scratch = events[:-2] + [rec(9.0, 1, group=1), rec(9.0, 5)]
    assert ftbridge_resume(scratch, kill_time=2.5)["committed_lost"] == 2


def test_metrics_and_plots_from_synthetic_runs(tmp_path, monkeypatch):
    from ftbridge.harness.bench import failover, failure_jobs, heal, rescale, restart
    from ftbridge.harness.bench.core import Metric

    events = [rec(1.0, 1), rec(1.1, 2), rec(1.2, 3), rec(1.0, 1, group=1), rec(1.1, 2, group=1),
              rec(3.3, 4, participants=1), rec(6.0, 5, group=1)]
    runs = [failure_jobs.KillRun(1.25, events), failure_jobs.KillRun(1.25, events)]
    ms = failover.stall_metrics("failover", runs)
    assert ms[0].value == pytest.approx((3.3 - 1.25) / (2.0 + 0.1)) and ms[0].met
    lost = next(m for m in ms if m.name.startswith("committed steps lost"))
    assert lost.samples == [0.0, 0.0] and lost.met
    # Group 1 back from scratch: the survivor's counter never went back, yet 2 committed steps are lost.
    scratch = [failure_jobs.KillRun(1.25, events[:-1] + [rec(6.0, 1, group=1)])]
    lost = next(m for m in failover.stall_metrics("failover", scratch) if m.name.startswith("committed steps lost"))
    assert lost.samples == [2.0] and lost.met is False
    failover.plot(ms, str(tmp_path / "failover.png"))
    # The hang variant: same figures, prefixed, with the watch-off runs' stall as the stall's baseline.
    off = [failure_jobs.KillRun(1.25, events[:-2] + [rec(11.3, 4, participants=1), rec(13.0, 5, group=1)])]
    hang = failover.stall_metrics("failover", runs, prefix="hang: ", baseline_runs=off, baseline_name="watch off")
    assert [m.name for m in hang] == ["hang: " + m.name for m in ms]
    assert hang[1].value == pytest.approx(3.3 - 1.25) and hang[1].baseline == pytest.approx(11.3 - 1.25)
    heal_runs = [failure_jobs.KillRun(10.0, restarted_group_events())] * 2
    monkeypatch.setattr(failure_jobs, "ftbridge_kill_runs", lambda settings: heal_runs)
    monkeypatch.setattr(heal, "transport_alone", lambda mb, reps: [])
    hm = heal.run(BenchSettings(workdir=str(tmp_path), quick=True))
    assert hm[0].value == pytest.approx(7.0) and hm[-1].unit == "ratio" and hm[-1].value > 0
    heal.plot(hm, str(tmp_path / "heal.png"))
    x = {"plain_resume_s": [5.0], "survivors_s": [2.0], "rejoined_s": [6.0], "plain_lost": [3], "ftbridge_lost": [0],
         "survivors_fast_heartbeat_s": [0.6]}
    restart.plot([Metric("restart", "r", 2.5, "ratio", extra=x)], str(tmp_path / "restart.png"))
    y = {k: [1.0] for k in ("convert_s", "plain_load_s", "plain_proc_s", "ft_load_s", "ft_proc_s")}
    rescale.plot([Metric("rescale", "r", 0.5, "ratio", extra=y)], str(tmp_path / "rescale.png"))
    assert all((tmp_path / f"{n}.png").stat().st_size > 0 for n in ("failover", "heal", "restart", "rescale"))


@pytest.mark.timeout(180)
def test_transport_alone_fetches_the_served_state_from_another_process():
    from ftbridge.harness.bench import heal

    ratio, encode = heal.transport_alone(4, 2)
    assert ratio.unit == "ratio" and len(ratio.samples) == 2 and ratio.value > 0
    assert ratio.extra["bytes"] > 4 * 2**20  # the four 1 M-element fp32 tensors and the header all arrived
    assert encode.unit == "MB/s" and encode.value > 0


def test_plain_kill_never_lands_inside_a_save(tmp_path):
    # A tiny model runs several steps between two polls: the kill must not land in the save of a step
    # that is a multiple of `every` (plain DeepSpeed then leaves `latest` naming half-written files).
    import signal
    import subprocess
    import time

    from ftbridge.harness.bench.failure_jobs import _kill_between_saves
    from ftbridge.launch.processes import pid_alive

    rank0 = subprocess.Popen(["sleep", "60"])
    torchrun = subprocess.Popen(["sleep", "60"])
    seen = []  # rank 0's recorded steps, as each poll finds them
    # Each poll reads once, and so does the check after SIGSTOP.
    script = iter([[5], [5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 8, 9, 10, 11]])

    def steps():
        seen.append(next(script))
        return [{"step": s} for s in seen[-1]]
    log = tmp_path / "plain.log"
    log.write_text("")
    try:
        t0 = time.time()
        kill_time, pid = _kill_between_saves(torchrun, steps, lambda: rank0.pid, 4, 30.0, str(log))
        assert pid == rank0.pid and kill_time >= t0
        rank0.wait(timeout=10)
        assert rank0.returncode == -signal.SIGKILL and not pid_alive(rank0.pid)
        # Window at 6: rank 0 had reached 8 (its save) -> resumed; window at 10: last 11 -> killed.
        assert [s[-1] for s in seen] == [5, 8, 8, 11, 11]
    finally:
        for p in (rank0, torchrun):
            if p.poll() is None:
                p.kill()
                p.wait()
