"""Chaos scenarios, one failure each, with what must hold afterwards.

Other scenarios live next to the code they exercise: a replica killed during
the cross-replica all-reduce (test_failover.py), the donor killed while a
joiner heals (test_heal_failures.py), the lighthouse restarted after a 10 s
outage (test_lighthouse_restart.py), and one failure of every kind in one
seeded run (test_chaos_run.py).
"""

from __future__ import annotations

import glob
import os
import signal
import time
from datetime import timedelta

import pytest

from ftbridge import faults
from ftbridge.config import FTBridgeConfig
from ftbridge.harness.chaos import invariants
from ftbridge.launch.processes import pid_alive
from tests.conftest import TINY


def _launches(job, group, rank=0):
    return sorted(e["time"] for e in job.events(group, rank) if e.get("event") == "start")


def _finish(job, groups, extra=5, timeout_s=240):
    target = job.stop_soon(extra)
    codes = job.wait(timeout_s=timeout_s)
    assert codes == {g: 0 for g in groups}, job.tails()
    finals = [e for e in job.events() if e.get("event") == "final"]
    assert len(finals) == len(groups) * job.nproc and {f["step"] for f in finals} == {target}, finals
    assert len({f["param_checksum"] for f in finals}) == 1, finals
    assert invariants.check_all(job.events()) == []
    return target


def _job(local_job, groups, nproc, env=None):
    job = local_job(groups, nproc, [*TINY, "--steps", "100000"], max_restarts=3, env=env)
    job.script_args += ["--stop-file", f"{job.workdir}/stop"]
    return job


@pytest.mark.timeout(360)
def test_killed_after_its_first_quorum_request_before_training(local_job, tmp_path):
    fault_dir = str(tmp_path / "faults")
    job = _job(local_job, 2, 1, env={faults.ENV_DIR: fault_dir})
    job.start(groups=[0])
    job.wait_step(0, 1, timeout_s=120)
    faults.arm(fault_dir, "first_quorum", group=1)
    job.start_group(1)
    job.wait_until(lambda: faults.fired(fault_dir, "first_quorum"), 120, "group 1 to die in its first quorum")
    t_dead = os.path.getmtime(os.path.join(fault_dir, "first_quorum.fired"))
    # The survivor forms quorums without it and trains on alone.
    job.wait_until(lambda: any(e["committed"] and e["participants"] == 1 and e["time"] > t_dead
                               for e in job.steps(0)), 60, "group 0 to commit alone")
    # torchrun restarts group 1, which is admitted by healing.
    job.wait_until(lambda: any(e["healed"] for e in job.steps(1)), 180, "group 1 to come back and heal")
    _finish(job, [0, 1])
    starts = _launches(job, 1)
    assert len(starts) == 2
    assert not [e for e in job.steps(1) if e["time"] < starts[1]], "group 1 trained before it was killed"
    assert len(_launches(job, 0)) == 1 and not any(e["healed"] for e in job.steps(0))


@pytest.mark.timeout(420)
def test_three_groups_started_at_different_steps_each_joiner_heals_once(local_job):
    job = _job(local_job, 3, 1)
    job.start(groups=[0])
    job.wait_step(0, 5, timeout_s=120)
    job.start_group(1)
    job.wait_until(lambda: any(e["healed"] for e in job.steps(1)), 120, "group 1 to heal")
    job.wait_step(1, job.max_step() + 5, timeout_s=120)
    job.start_group(2)
    job.wait_until(lambda: any(e["healed"] for e in job.steps(2)), 120, "group 2 to heal")
    _finish(job, [0, 1, 2])
    assert not any(e["healed"] for e in job.steps(0)), "the group that was there first healed"
    for g in (1, 2):
        assert sum(e["healed"] for e in job.steps(g)) == 1, f"group {g} healed more than once"
        assert len(_launches(job, g)) == 1


@pytest.mark.timeout(420)
def test_rank_hung_past_the_cross_replica_timeout(local_job):
    # Three groups: torchft's lighthouse forms a quorum only from more than half of the groups that
    # heartbeat, and the hung group's rank 0 (its manager) still heartbeats, so with two groups the
    # survivor would wait for it (docs/troubleshooting.md).
    # The hung group's rank 0 may be waiting for the hung rank's commit vote, which torchft bounds by
    # 2 x the cross-replica timeout; past that it exits and torchrun restarts the group (safe: a rank
    # that gave up on the vote must not go on, or the group's ranks could decide differently). The
    # hang here lasts about the cross-replica timeout plus a quorum, so 6 s leaves 3-4 s of margin
    # (4 s left 1-2 s; on a loaded CI machine the group once restarted, most likely so).
    timeout_s = 6.0
    job = _job(local_job, 3, 2, env={"FTBRIDGE_CROSS_REPLICA_TIMEOUT_S": str(timeout_s)})
    job.start()
    job.wait_until(lambda: any(e["committed"] and e["participants"] == 3 for e in job.steps(0)), 120,
                   "all groups to commit together")
    pid = job.worker_pids(1)[1]
    t_stop = time.time()
    os.kill(pid, signal.SIGSTOP)
    try:
        # The others go on without the hung group: they discard a step whose all-reduce waits on it
        # (after the cross-replica timeout), or, if it froze between steps, the next quorum leaves it out.
        # Both of them, before SIGCONT (the final check asks for this; they may commit milliseconds apart).
        job.wait_until(lambda: all(any(e["committed"] and e["participants"] == 2 and e["time"] > t_stop
                                       for e in job.steps(g)) for g in (0, 2)), 60,
                       "groups 0 and 2 to commit without the hung group")
        # Hung past the cross-replica timeout, the failure this scenario is about.
        job.wait_until(lambda: time.time() > t_stop + timeout_s + 1, timeout_s + 5, "the hang to pass the timeout")
    finally:
        os.kill(pid, signal.SIGCONT)
    t_cont = time.time()
    hang_s = t_cont - t_stop
    job.wait_heal(1, t_stop, 120, "the hung group to catch up by healing")  # (it cannot before SIGCONT)
    _finish(job, [0, 1, 2])
    assert pid_alive(pid) is False  # ended with the job, not killed by the hang
    # The others went on without a restart (no watchdog killed them), committing without the hung group.
    # Launches are judged from the hang on: under load a group may restart while the three first meet
    # (a 4 s cross-replica timeout at start-up, seen once in CI), which is not what this scenario tests.
    for g in (0, 2):
        assert [t for r in (0, 1) for t in _launches(job, g, r) if t > t_stop] == [], f"group {g} restarted"
        assert any(e["committed"] and e["participants"] == 2 and t_stop < e["time"] < t_cont for e in job.steps(g))
    restarts = [t for t in _launches(job, 1) if t > t_stop]
    bound_s = FTBridgeConfig(cross_replica_timeout=timedelta(seconds=timeout_s)).torchft_timeout.total_seconds()
    if hang_s + 0.5 < bound_s:  # within torchft's should_commit bound (see the top): no restart
        assert restarts == [], (f"the hung group was restarted instead of healing (hung {hang_s:.1f} s, "
                                f"commit-vote bound {bound_s:.0f} s)\n{job.tails()}")
    else:  # a loaded machine kept the others from going on in time; the group still came back by healing
        print(f"hung {hang_s:.1f} s, past the commit-vote bound; group 1 restarts: {len(restarts)}")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rank_frozen_inside_its_quorum_call_past_one_try_rejoins_without_a_restart(local_job, tmp_path):
    # A rank frozen with a quorum try in flight for longer than that try's deadline (quorum_timeout / tries,
    # 5 s here). Most often its group's rank 0 got the lighthouse's answer of that round and this rank's
    # copy of it is lost to its expired deadline (OutageRider._lost_answer): the group discards that step.
    # Either way the group must come back without dying and being restarted, as after any pause shorter
    # than the commit-vote bound (12 s here).
    fault_dir = str(tmp_path / "faults")
    job = _job(local_job, 3, 2, env={faults.ENV_DIR: fault_dir, "FTBRIDGE_CROSS_REPLICA_TIMEOUT_S": "6"})
    job.start()
    job.wait_until(lambda: any(e["committed"] and e["participants"] == 3 for e in job.steps(0)), 120,
                   "all groups to commit together")
    t_arm = time.time()
    faults.arm(fault_dir, "in_quorum_call", group=1, rank=1, freeze_s=7)
    job.wait_until(lambda: faults.fired(fault_dir, "in_quorum_call"), 60, "group 1 rank 1 to freeze in a quorum call")
    t_fired = os.path.getmtime(os.path.join(fault_dir, "in_quorum_call.fired"))
    job.wait_until(lambda: all(any(e["committed"] and e["participants"] == 3 and e["time"] > t_fired + 7
                                   for e in job.steps(1, r)) for r in (0, 1)), 120,
                   "the frozen group to commit with the others again")
    _finish(job, [0, 1, 2])
    restarts = [t for r in (0, 1) for t in _launches(job, 1, r) if t > t_arm]
    assert restarts == [], f"the frozen group was restarted\n{job.tails()}"
    logs = glob.glob(os.path.join(job.workdir, "group_1.*.log"))
    lost = sum(open(f, encoding="utf-8", errors="replace").read().count("quorum its rank 0 got was lost") for f in logs)
    print(f"answers lost to the freeze: {lost}")


@pytest.mark.slow  # ~35 s; every soak slice and ftbridge-chaos run checks the final loss the same way
@pytest.mark.timeout(420)
def test_final_loss_matches_a_failure_free_run(local_job):
    job = _job(local_job, 2, 1)
    job.start()
    job.wait_until(lambda: any(e["committed"] and e["participants"] == 2 for e in job.steps(1)), 120,
                   "both groups to commit together")
    job.wait_step(1, job.max_step() + 20, timeout_s=120)
    t_kill = time.time()
    job.kill_workers(1)
    job.wait_heal(1, t_kill, 180, "group 1 to heal")
    target = _finish(job, [0, 1], extra=40)

    # The same job, same seed, same number of steps, no failure (both groups from the first step).
    clean = local_job(2, 1, [*TINY, "--steps", str(target)], lighthouse_min_replicas=2)
    clean.start()
    assert clean.wait(timeout_s=300) == {0: 0, 1: 0}, clean.tails()

    def loss(j):
        return {e["val_loss"] for e in j.events() if e.get("event") == "final"}
    assert len(loss(job)) == 1 and len(loss(clean)) == 1
    # Tolerance (0.15 nats, as ftbridge-chaos): while group 1 restarts (20-30 s here), group 0 trains
    # alone on half of each global batch, for hundreds of steps of this tiny model. Measured: 0.055.
    assert invariants.final_loss_close(loss(job).pop(), loss(clean).pop(), 0.15) == [], (loss(job), loss(clean))
