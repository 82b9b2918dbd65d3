"""The commit protocol against real faults with real processes: a wedge, a hung lighthouse, blackholed and
one-way links, a group restarted after the job ended (2 replica groups x 1 rank, the tiny model).

Each case once broke the promise on the landed code (docs/concepts.md, "The commit protocol"): the lone
group under ``--min-replicas 2`` spun at a full core and never exited; a SIGSTOPped lighthouse or a
blackholed link stopped every group for the whole fault (a TCP connect still succeeded); a group cut off
one way never committed again; a group restarted after the others finished trained alone from step 0.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from ftbridge.harness.local_job import parent_pid
from ftbridge.launch.processes import cpu_seconds, pid_alive
from tests.conftest import TINY

FAULT_S = 6.0
"""How long each fault lasts (the issue's runs used 15 s; 6 s shows the same, sooner)."""


def _together(job, step, since=0.0, rode=None):
    return all(any(e["committed"] and e["step"] >= step and e["time"] >= since and e["participants"] == 2
                   and (rode is None or bool(e.get("rode_out_outage")) == rode) for e in job.steps(g)) for g in (0, 1))


def _commits(job, group, start, end):
    return [e for e in job.steps(group) if e["committed"] and start <= e["time"] <= end]


def _longest_gap(job, group, start, end):
    times = [start] + [e["time"] for e in _commits(job, group, start, end)] + [end]
    return max(b - a for a, b in zip(times, times[1:]))


def _stop_with_one_model(job):
    """Stop both groups; each exits 0 and both end with the same parameters."""
    job.stop_soon(2)
    codes = job.wait(timeout_s=120)
    assert codes == {0: 0, 1: 0}, job.tails()
    finals = [e for e in job.events() if e.get("event") == "final"]
    assert len(finals) == 2 and len({f["param_checksum"] for f in finals}) == 1, finals


def _fault(job, on, off, what):
    """Apply a fault for :data:`FAULT_S`, then wait until both groups commit together from the lighthouse."""
    t0 = time.time()
    on()
    time.sleep(FAULT_S)  # the fault itself: it lasts this long (not a synchronisation)
    t1 = time.time()
    off()
    job.wait_until(lambda: _together(job, 1, since=t1, rode=False), 120,
                   f"both groups to commit together from the lighthouse after the {what}")
    return t0, t1


def _rode_out(job, t0, t1, what):
    for g in (0, 1):
        rode = [e for e in _commits(job, g, t0, t1) if e.get("rode_out_outage")]
        gap = _longest_gap(job, g, t0 + 1.0, t1)
        print(f"{what}: group {g} committed {len(rode)} steps on the last quorum in {t1 - t0:.1f} s; "
              f"longest pause {gap:.2f} s")
        assert len(rode) >= 5, f"group {g} rode out the {what} with only {len(rode)} commits"
        assert gap < 3.0, f"group {g} paused {gap:.1f} s during the {what}"


@pytest.mark.timeout(400)
def test_a_hung_lighthouse_blackholed_links_and_a_one_way_cut_cost_no_wedge_and_no_split(local_job):
    """One job, three faults in turn: each once stopped the job for the whole fault, or for good."""
    job = local_job(2, 1, [*TINY, "--steps", "100000"], max_restarts=0, lighthouse_process=True, proxies=True)
    job.script_args += ["--stop-file", f"{job.workdir}/stop"]
    job.start()
    job.wait_until(lambda: _together(job, 3), 180, "both groups to commit step 3 together")

    pid = job.lighthouse_pid
    t0, t1 = _fault(job, lambda: os.kill(pid, signal.SIGSTOP), lambda: os.kill(pid, signal.SIGCONT),
                    "hung lighthouse")
    _rode_out(job, t0, t1, "hung lighthouse")

    def every(mode):
        for g in (0, 1):
            job.proxy(g).set(mode)

    t0, t1 = _fault(job, lambda: every("blackhole"), lambda: every("pass"), "blackhole")
    _rode_out(job, t0, t1, "blackhole")

    # Group 0's requests reach the lighthouse, its answers do not: the landed code wedged it for good.
    t0, t1 = _fault(job, lambda: job.proxy(0).set("oneway"), lambda: job.proxy(0).set("pass"), "one-way cut")
    print(f"one-way cut: group 0 committed {len(_commits(job, 0, t0, t1))} steps during it, group 1 "
          f"{len(_commits(job, 1, t0, t1))}")

    _stop_with_one_model(job)
    by_step = {}
    for e in job.events():
        if e.get("committed") and e.get("param_checksum"):
            by_step.setdefault(e["step"], set()).add(e["param_checksum"])
    split = {s: c for s, c in by_step.items() if len(c) > 1}
    assert not split, f"groups committed one step with different parameters: {split}"


@pytest.mark.timeout(300)
def test_a_lone_group_under_min_replicas_exits_at_the_quorum_timeout_without_spinning(local_job):
    job = local_job(2, 1, [*TINY, "--steps", "100000"], max_restarts=0, lighthouse_min_replicas=2,
                    env={"FTBRIDGE_QUORUM_TIMEOUT_S": "10"})
    job.start()
    job.wait_until(lambda: _together(job, 3), 180, "both groups to commit step 3 together")
    pid = job.worker_pids(0)[0]
    job.kill_workers(1)
    t_kill, samples = time.time(), []

    def ended():
        used = cpu_seconds(pid)
        if used is not None:
            samples.append((time.monotonic(), used))
        return not pid_alive(pid)

    job.wait_until(ended, 90, "group 0's rank to exit on its quorum timeout")
    took = time.time() - t_kill
    codes = job.wait(timeout_s=60)
    assert codes[0] != 0, job.tails()
    assert "no quorum within the quorum timeout (10 s, FTBRIDGE_QUORUM_TIMEOUT_S)" in job.log_text(0), job.tails()
    assert took < 10 + 2 + 30, f"group 0 took {took:.0f} s to exit"  # quorum timeout + heartbeat + start slack
    (a, ca), (b, cb) = samples[0], samples[-1]
    print(f"lone group exited {took:.1f} s after the kill, using {cb - ca:.1f} s of CPU in {b - a:.1f} s")
    assert (cb - ca) < 0.5 * (b - a), "the lone group's rank spun while it waited for a quorum"


@pytest.mark.timeout(300)
def test_a_group_restarted_after_the_job_ended_does_not_train_a_second_model(local_job):
    job = local_job(2, 1, [*TINY, "--steps", "100000"], max_restarts=1, env={"FTBRIDGE_RESTART_PEER_WAIT_S": "5"})
    job.script_args += ["--stop-file", f"{job.workdir}/stop"]
    job.start()
    job.wait_until(lambda: _together(job, 5), 180, "both groups to commit step 5 together")
    worker = job.worker_pids(1)[0]
    agent = parent_pid(worker)
    os.kill(agent, signal.SIGSTOP)  # group 1's torchrun cannot restart it until the others have finished
    try:
        job.kill_workers(1)
        job.stop_soon(5)  # group 0 ends the job alone
        assert job.wait(timeout_s=180, groups=[0]) == {0: 0}, job.tails()
        t_restart = time.time()
    finally:
        os.kill(agent, signal.SIGCONT)
    codes = job.wait(timeout_s=180, groups=[1])
    assert codes[1] != 0, job.tails()
    log = job.log_text(1)
    assert "NoPeerToHealFrom" in log and "does not train alone from step 0" in log, job.tails()
    late = [e for e in job.steps(1) if e["time"] >= t_restart]
    assert late and not any(e["committed"] for e in late), late
    assert any(e.get("event") == "restart_without_peer" and e.get("stopped") for e in job.events(1))


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_group_cut_off_from_its_only_peer_stands_aside_and_the_other_trains_on(local_job):
    """2 groups on hosts of their own; one is cut off from the other, not from the lighthouse, for 40 s.

    Without the stand-aside rule neither group committed for the whole cut (the lighthouse's majority rule
    counts the cut-off group's heartbeats). Now the group that cannot reach the quorum's store stands
    aside, the other trains on, and after the cut both commit together with one model.
    """
    from ftbridge.harness import netns

    if netns.available():
        pytest.skip(netns.available())
    cut_s = 40.0
    job = local_job(2, 1, [*TINY, "--steps", "100000"], max_restarts=0, hosts=True,
                    env={"FTBRIDGE_CROSS_REPLICA_TIMEOUT_S": "3", "FTBRIDGE_STAND_ASIDE_S": "10"})
    job.script_args += ["--stop-file", f"{job.workdir}/stop"]
    job.start()
    job.wait_until(lambda: _together(job, 3), 180, "both groups to commit step 3 together")
    t0 = time.time()
    job.group_hosts.cut(1)
    time.sleep(cut_s)  # the fault itself: it lasts this long (not a synchronisation)
    t1 = time.time()
    job.group_hosts.mend(1)
    job.wait_until(lambda: _together(job, 1, since=t1), 120, "both groups to commit together after the cut")
    asides = [e for e in job.events() if e.get("event") == "stand_aside" and t0 <= e["time"] <= t1]
    trained = {g: len(_commits(job, g, t0, t1)) for g in (0, 1)}
    gaps = {g: _longest_gap(job, g, t0, t1) for g in (0, 1)}
    print(f"cut {cut_s:g} s: stand-asides {[(e['replica_group'], e['seconds']) for e in asides]}, commits "
          f"{trained}, longest pause {gaps}")
    assert asides, "no group stood aside while cut off from its only peer"
    stood = {e["replica_group"] for e in asides}
    assert len(stood) == 1, f"both sides stood aside: {asides}"
    other = 1 - stood.pop()
    assert trained[other] > 0 and gaps[other] < cut_s - 10, (
        f"group {other} did not train on while its peer stood aside: {trained}, longest pause {gaps}")
    _stop_with_one_model(job)
