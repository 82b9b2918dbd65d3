"""Training through a lighthouse outage with a real lighthouse stopped and started again (ftbridge.manager.outage).

Replica groups of 1 rank each, the tiny model. While the lighthouse is down the groups keep
committing on their last quorum; a group that fails during the outage stops the others' commits
until the lighthouse is back (3 groups: the survivors are a majority after the restart); a group
that starts during the outage joins only after it (slow).
The plain outage (both groups ride it and end identical) is ``test_lighthouse_restart.py``.
"""

from __future__ import annotations

import time

import pytest

from ftbridge.launch.processes import pid_alive
from tests.conftest import TINY


def _together(job, groups, step, since=0.0):
    return all(any(e["committed"] and e["step"] >= step and e["time"] >= since and e["participants"] == len(groups)
                   for e in job.steps(g)) for g in groups)


RIDE = {"FTBRIDGE_QUORUM_RETRIES": "29", "FTBRIDGE_RIDE_OUT_LIGHTHOUSE_OUTAGE": "1"}
"""Riding out the outage (on by default, said again here) and more lighthouse retries: the fallback resumes sooner."""


def _rode(job, group, since):
    return [e for e in job.steps(group) if e["committed"] and e.get("rode_out_outage") and e["time"] >= since]


@pytest.mark.slow  # the default suite rides a plain outage (test_lighthouse_restart.py); this one costs ~60 s
@pytest.mark.timeout(240)
def test_a_group_failing_during_the_outage_stops_the_others_until_the_lighthouse_is_back(local_job):
    # Three groups: after the restart the two survivors are a majority of the last quorum before it and go on
    # (with two groups the lone survivor cannot tell its dead peer from a cut-off one, and stops: concepts.md).
    # 1 s between torchft's lighthouse retries (30 s / 30) instead of 5 s: the fallback resumes sooner.
    job = local_job(3, 1, [*TINY, "--steps", "100000"], max_restarts=0, env=RIDE)
    job.script_args += ["--stop-file", f"{job.workdir}/stop"]
    job.start()
    job.wait_until(lambda: _together(job, (0, 1, 2), 3), 150, "the three groups to commit step 3 together")

    stopped = time.time()
    job.stop_lighthouse()
    job.wait_until(lambda: all(len(_rode(job, g, stopped)) >= 5 for g in (0, 1, 2)), 60,
                   "the three groups to commit 5 steps without the lighthouse")
    killed = job.kill_workers(2)
    t_kill = time.time()
    time.sleep(2.0)  # the fault itself: the lighthouse stays down this long after the kill (not a synchronisation)
    after_kill = [e for g in (0, 1) for e in job.steps(g) if e["committed"] and e["time"] > t_kill]
    job.start_lighthouse()
    restarted = time.time()

    # Groups 0 and 1 wait for the lighthouse, then go on together in a new quorum.
    job.wait_until(lambda: _together(job, (0, 1), 1, since=restarted), 90,
                   "groups 0 and 1 to commit together after the lighthouse is back")
    job.stop_soon(2)
    codes = job.wait(timeout_s=60)  # group 2's launcher too: its only rank was killed, torchrun gives up
    assert codes[0] == 0 and codes[1] == 0 and codes[2] != 0, job.tails()

    # The step in flight at the kill may still commit: group 2 can have added its row to that step's agreement
    # before it died (its all-reduce then completes for the others). No step after it may.
    in_flight = {e["step"] for e in after_kill}
    assert len(in_flight) <= 1 and len(after_kill) <= 2, (
        f"a survivor committed without the lighthouse after its peer died: {after_kill}")
    resumed = [e for g in (0, 1) for e in job.steps(g) if e["committed"] and e["time"] > restarted]
    # If only one survivor completed that in-flight step, the other heals from it at the first quorum.
    heals = {e["step"] for e in resumed if e["healed"]}
    odd = [e for e in resumed if e.get("rode_out_outage") or (e["participants"] != 2 and e["step"] not in heals)]
    assert resumed and not odd and len(heals) <= 1, f"after the lighthouse came back: {odd or resumed[:4]}"
    finals = [e for e in job.events() if e.get("event") == "final"]
    assert len(finals) == 2 and len({f["param_checksum"] for f in finals}) == 1, finals
    launchers = [gp.proc.pid for launches in job.groups.values() for gp in launches]
    assert not any(pid_alive(p) for p in killed + job.all_worker_pids() + launchers)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_group_starting_during_the_outage_joins_only_after_it(local_job):
    # torchft's manager dials the lighthouse when it is built and gives up after connect_timeout: the
    # late group fails to start while the lighthouse is down, and torchrun starts it again.
    job = local_job(3, 1, [*TINY, "--steps", "100000"], max_restarts=5, env=RIDE)
    job.script_args += ["--stop-file", f"{job.workdir}/stop"]
    job.start(groups=[0, 1])
    job.wait_until(lambda: _together(job, (0, 1), 3), 150, "groups 0 and 1 to commit step 3 together")

    stopped = time.time()
    job.stop_lighthouse()
    job.start_group(2)
    started = time.time()
    time.sleep(15.0)  # the fault itself: the lighthouse stays down this long after group 2 started
    joined_early = job.steps(2)
    rode = {g: _rode(job, g, started) for g in (0, 1)}
    job.start_lighthouse()
    restarted = time.time()

    job.wait_until(lambda: _together(job, (0, 1, 2), 1, since=restarted), 120, "all three groups together")
    target = job.stop_soon()
    codes = job.wait(timeout_s=120)
    assert codes == {0: 0, 1: 0, 2: 0}, job.tails()

    assert not joined_early, f"group 2 stepped while the lighthouse was down: {joined_early[:3]}"
    assert all(len(v) >= 10 for v in rode.values()), {g: len(v) for g, v in rode.items()}
    assert job.healed_since(2, restarted)
    finals = [e for e in job.events() if e.get("event") == "final"]
    assert len(finals) == 3 and len({f["param_checksum"] for f in finals}) == 1, finals
    assert {f["step"] for f in finals} == {target}
    launchers = [gp.proc.pid for launches in job.groups.values() for gp in launches]
    assert not any(pid_alive(p) for p in job.all_worker_pids() + launchers)
    print(f"outage {restarted - stopped:.1f} s; riding commits while group 2 waited: "
          f"{ {g: len(v) for g, v in rode.items()} }")
