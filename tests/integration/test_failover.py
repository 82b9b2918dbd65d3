"""A replica group dies; the survivors go on; the group restarts, heals, and all end identical.

Group 0 starts first and commits a step before group 1 starts, so group 1
joins by healing; group 0 must never heal and never restart. The run's end
is set through a stop file once the scenario has played out (no timing
assumptions about step speed). Every rank's final parameters, Adam moments
(optimizer checksum), lr and scheduler step are compared at the end.
"""

from __future__ import annotations

import re
import time

import pytest

from ftbridge.local_job import pid_alive
from tests.conftest import TINY


def _start_staggered(local_job, fault=None, stage=2, env=None, extra=()):
    job = local_job(2, 2, [*TINY, "--steps", "100000", "--zero-stage", str(stage), *extra], max_restarts=2,
                    env=env)
    job.script_args += ["--stop-file", f"{job.workdir}/stop"]
    if fault:
        job.script_args += [fault, f"{job.workdir}/FAULT", "--fault-group", "1",
                            "--fault-rank", "0"]
    job.start(groups=[0])
    job.wait_step(0, 1, timeout_s=120)
    job.start_group(1)
    job.wait_until(lambda: any(e["healed"] for e in job.steps(1)), 120, "group 1 to join by healing")
    return job


def _finish(job, extra_steps=10):
    target = job.max_step() + extra_steps
    job.write_file("stop", str(target))
    codes = job.wait(timeout_s=180)
    assert codes == {0: 0, 1: 0}, job.tails()
    return target


def _launches(job, group, rank=0):
    return sorted(e["time"] for e in job.events(group, rank) if e.get("event") == "start")


def _healed_after_restart(job, group):
    starts = _launches(job, group)
    return len(starts) >= 2 and job.healed_since(group, starts[-1])


def _launch_windows(job, group):
    starts = _launches(job, group)
    return list(zip(starts, starts[1:] + [float("inf")]))


def _assert_identical_finals(job, target):
    finals = [e for e in job.events() if e.get("event") == "final"]
    assert len(finals) == 4, job.tails()
    assert {f["step"] for f in finals} == {target}
    assert len({f["param_checksum"] for f in finals}) == 1, finals
    for r in (0, 1):
        mine = [f for f in finals if f["group_rank"] == r]
        assert len({f["optimizer_checksum"] for f in mine}) == 1, mine
    assert len({f["lr"] for f in finals}) == 1 and len({f["scheduler_step"] for f in finals}) == 1


def _assert_commits_consistent(job):
    """Committed steps never repeat or go back within a launch; replicas committing a step agree."""
    by_step = {}
    for g in (0, 1):
        for start, end in _launch_windows(job, g):
            steps = [e["step"] for e in job.steps(g) if start <= e["time"] < end and e["committed"]]
            assert steps == sorted(set(steps)), f"group {g} committed steps repeat or go back: {steps}"
        for e in job.steps(g):
            if e["committed"] and e["participants"] == 2:
                by_step.setdefault(e["step"], set()).add(e["param_checksum"])
    assert all(len(v) == 1 for v in by_step.values()), {k: v for k, v in by_step.items() if len(v) > 1}


@pytest.mark.timeout(420)
@pytest.mark.parametrize("extra", [
    pytest.param((), id="no-offload"),
    # Optimizer offload, the cross-replica all-reduce in every micro-step, CPU accumulation between them.
    pytest.param(("--offload-optimizer", "--grad-accum", "2"), marks=pytest.mark.slow, id="offload-gas2"),
    pytest.param(("--offload-optimizer", "--zero-stage", "3"), marks=pytest.mark.slow, id="offload-zero3"),
])
def test_killed_group_restarts_heals_once_and_ends_identical(local_job, extra):
    job = _start_staggered(local_job, extra=extra)
    job.wait_step(1, job.max_step() + 3, timeout_s=120)
    kill_time = time.time()
    pids = job.kill_workers(1)
    assert not any(pid_alive(p) for p in pids)
    job.wait_heal(1, kill_time, 180, "restarted group 1 to heal")
    target = _finish(job)

    # The survivors never restarted, never healed, and kept committing while group 1 was down.
    assert len(_launches(job, 0)) == 1
    assert not any(e["healed"] for e in job.steps(0))
    alone = [e for e in job.steps(0) if e["time"] > kill_time and e["committed"] and e["participants"] == 1]
    assert alone, "group 0 did not commit any step on its own after group 1 died"
    # torchrun (the same ftbridge-run) restarted group 1, which healed exactly once per launch.
    assert len(job.groups[1]) == 1 and len(_launches(job, 1)) == 2
    for start, end in _launch_windows(job, 1):
        heals = [e for e in job.steps(1) if start <= e["time"] < end and e["healed"]]
        assert len(heals) == 1, f"group 1 launch at {start}: {len(heals)} heals"
    _assert_commits_consistent(job)
    _assert_identical_finals(job, target)


@pytest.mark.timeout(420)
def test_peer_killed_during_cross_replica_allreduce_discards_step(local_job):
    # Group 1 rank 0 dies once it is in the step's quorum, before its backward: group 0's all-reduce of
    # that step has a participant that never sends. (Killing it after its backward races: the
    # all-reduce may already have completed, and then the step rightly commits.)
    job = _start_staggered(local_job, fault="--fault-kill-in-allreduce")
    job.write_file("FAULT", "")
    job.wait_until(lambda: "FAULT replica 1 rank 0" in job.log_text(1), 120, "the fault to fire")
    job.wait_until(lambda: _healed_after_restart(job, 1), 240, "group 1 to restart and heal")
    target = _finish(job)
    fault_step = int(re.search(r"FAULT replica 1 rank 0: SIGKILL self after joining the quorum of step (\d+)",
                               job.log_text(1)).group(1))

    # On the survivor the step whose all-reduce lost its peer is discarded on both ranks; the next commits.
    for r in (0, 1):
        records = job.steps(0, r)
        discarded = [i for i, e in enumerate(records) if not e["committed"]]
        assert discarded, f"group 0 rank {r} discarded no step"
        first = discarded[0]
        assert records[first]["step"] == fault_step, (records[first], fault_step)
        assert any(e["committed"] for e in records[first + 1:first + 3])
    assert len(_launches(job, 0)) == 1, "the survivor restarted"
    _assert_commits_consistent(job)
    _assert_identical_finals(job, target)
