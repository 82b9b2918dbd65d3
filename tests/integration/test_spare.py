"""A warm spare takes a killed group's place: 2 active groups x 1 rank + 1 spare, tiny model.

The spare stands by while both groups commit together; group 1 is
SIGKILLed. The spare must take over group 1's id, heal, and train; group 1's
torchrun restart comes back after that and must stand by as a spare instead
of joining as a second group 1. At the end the survivor and the spare hold
the same parameters and optimizer state, the spare read exactly group 1's
data shard (what a cold restart of group 1 reads), every launcher exited 0
and no process of the job is left.

Run with 1 and 2 ranks per group (the spare's other ranks take rank 0's
decision from the group's TCPStore). About 35-110 s per case on 2 shared
cores, most of it three DeepSpeed start-ups: the 1-rank case is the default
suite's end-to-end check of warm spares (the quick benchmarks skip ``spare``);
the 2-rank case and the paused-group case are marked slow.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from ftbridge.events import read_events, tensor_checksum
from ftbridge.harness.data import ShardedTextData, load_text
from ftbridge.harness.local_job import parent_pid
from ftbridge.launch.processes import pid_alive
from tests.conftest import TINY


def _expected_input_checksum(data: ShardedTextData, step: int, micro: int, rank: int, nproc: int) -> str:
    x, _ = data.get_batch(step, micro, dp_rank=nproc + rank, dp_world_size=2 * nproc)  # group 1's rows
    return tensor_checksum([x])


@pytest.mark.timeout(420)
@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow)], ids=["1-rank", "2-ranks"])
def test_spare_replaces_a_killed_group(local_job, nproc):
    # restart_peer_wait: how long a standing-by spare waits, after the last live group, before it exits
    job = local_job(2, nproc, [*TINY, "--steps", "100000", "--log-batches"], max_restarts=1,
                    env={"OMP_NUM_THREADS": "1", "FTBRIDGE_RESTART_PEER_WAIT_S": "3"})
    job.script_args += ["--stop-file", f"{job.workdir}/stop"]
    job.start()
    job.start_spare(0)
    job.wait_until(lambda: job.spare_ready(0), 120, "spare 0 to stand by")
    job.wait_until(lambda: all(any(e["committed"] and e["participants"] == 2 for e in job.steps(g)) for g in (0, 1)),
                   120, "both groups to commit together")
    assert not any(e.get("event") == "spare_join" for e in job.events()), "the spare joined a full job"

    # Group 1's torchrun is held stopped until the spare has taken the id, so that its restart comes back
    # after the takeover (as from a slow or rebooted node) and must stand by, not race the spare.
    (agent,) = {parent_pid(p) for p in job.worker_pids(1).values()}
    os.kill(agent, signal.SIGSTOP)
    try:
        kill_time = time.time()
        killed = job.kill_workers(1)
        job.wait_until(lambda: any(e.get("event") == "spare_join" for e in job.events(1)), 60, "the spare to join")
    finally:
        os.kill(agent, signal.SIGCONT)
    job.wait_heal(1, kill_time, 60, "the spare to heal as group 1")
    job.wait_until(lambda: any(e["committed"] and e["participants"] == 2 and e["time"] > kill_time
                               and not e["healed"] for e in job.steps(1)), 60, "the spare to train with group 0")
    demoted = [job.event_log(2 + 3, r) for r in range(nproc)]  # id N + index of restarted group 1 (spare N + 1)
    job.wait_until(lambda: all(any(e.get("event") == "spare_ready" for e in read_events([p])) for p in demoted),
                   120, "group 1's torchrun restart to stand by as a spare")
    target = job.stop_soon()
    assert job.wait(timeout_s=120) == {0: 0, 1: 0}, job.tails()  # group 1's launcher: its stand-by exited 0
    assert job.wait_spare(0, 120) == 0, job.tails()
    starts_after_kill = [e for e in job.events(1, 0) if e.get("event") == "start" and e["time"] > kill_time]
    assert len(starts_after_kill) == 1, f"a second group 1 joined: {starts_after_kill}"

    data = ShardedTextData(load_text(), context=32, micro_batch=4, seed=1234)
    for r in range(nproc):
        join = next(e for e in job.events(1, r) if e.get("event") == "spare_join")
        assert join["replaces"] == 1 and join["time"] > kill_time
        finals = {g: [e for e in job.events(g, r) if e.get("event") == "final"][-1] for g in (0, 1)}
        spare_pid = [e["pid"] for e in job.events(1, r) if e.get("event") == "start"][-1]
        assert spare_pid not in killed
        assert finals[0]["step"] == finals[1]["step"] == target
        assert finals[0]["param_checksum"] == finals[1]["param_checksum"]
        assert finals[0]["optimizer_checksum"] == finals[1]["optimizer_checksum"]
        assert finals[1]["heals"] >= 1
        spare_batches = [e for e in job.events(1, r) if e.get("event") == "batch" and e["time"] > join["time"]]
        assert spare_batches, f"the spare's rank {r} logged no batch"
        for e in spare_batches:
            assert (e["dp_rank"], e["dp_world_size"]) == (nproc + r, 2 * nproc), e
            assert e["input_checksum"] == _expected_input_checksum(data, e["step"], e["micro_step"], r, nproc), e

    job.stop()
    pids = job.all_worker_pids() + [e["pid"] for e in read_events(demoted) if "pid" in e]
    assert not [p for p in pids if pid_alive(p)]


def _two_groups_and_a_spare_standing_by(local_job, **job_kw):
    """2 groups x 1 rank until a stop file, started with spare 0; returns once both commit together and the
    spare stands by (``restart_peer_wait`` 3 s: how long a standing-by spare waits after the last live group)."""
    job = local_job(2, 1, [*TINY, "--steps", "100000"],
                    env={"OMP_NUM_THREADS": "1", "FTBRIDGE_RESTART_PEER_WAIT_S": "3"}, **job_kw)
    job.script_args += ["--stop-file", f"{job.workdir}/stop"]
    job.start()
    job.start_spare(0)
    job.wait_until(lambda: job.spare_ready(0) and all(
        any(e["committed"] and e["participants"] == 2 for e in job.steps(g)) for g in (0, 1)), 180,
        "both groups to commit together and the spare to stand by")
    return job


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_group_paused_past_the_heartbeat_timeout_leaves_when_it_finds_the_spare_in_its_place(local_job):
    """SIGSTOP group 1 until the spare has taken its place; on SIGCONT it must not train as a second group 1."""
    job = _two_groups_and_a_spare_standing_by(local_job, max_restarts=1)
    pause = time.time()
    paused = job.kill_workers(1, sig=signal.SIGSTOP)
    try:
        job.wait_until(lambda: any(e["committed"] and e["participants"] == 2 and not e["healed"]
                                   and e["time"] > pause for e in job.steps(1)), 120, "the spare to train as group 1")
    finally:
        for pid in paused:
            os.kill(pid, signal.SIGCONT)
    demoted = job.event_log(2 + 3, 0)
    job.wait_until(lambda: any(e.get("event") == "spare_ready" for e in read_events([demoted])), 120,
                   "the resumed group 1 to leave and stand by as a spare after its restart")
    job.stop_soon()
    assert job.wait(timeout_s=120) == {0: 0, 1: 0}, job.tails()
    assert job.wait_spare(0, 120) == 0, job.tails()
    assert "another member holds replica group 1" in job.log_text(1)
    trios = [e for g in (0, 1) for e in job.steps(g) if e["committed"] and e["participants"] > 2]
    assert not trios, f"steps committed by three groups (two copies of group 1): {trios[:3]}"
    finals = {g: [e for e in job.events(g) if e.get("event") == "final"][-1] for g in (0, 1)}
    assert finals[0]["param_checksum"] == finals[1]["param_checksum"]
    job.stop()
    pids = job.all_worker_pids() + [e["pid"] for e in read_events([demoted]) if "pid" in e]
    assert not [p for p in pids if pid_alive(p)]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_paused_lighthouse_does_not_make_the_spare_join_a_full_job(local_job):
    """SIGSTOP the lighthouse past the heartbeat timeout, then SIGCONT: on resuming it shows every group's
    heartbeat stale until the next ones arrive. The spare must read that as a lighthouse that was away (its
    reads failed meanwhile), not as vacancies: no join as a duplicate of a live group.

    With the settle rule switched off (``VacancyWatch.observe`` acting on the first read after failed ones)
    this passed 3 runs of 3 here: the groups' queued heartbeats reached the resumed lighthouse before the
    spare's next read. The rule is guarded by ``tests/test_spare.py``; this checks the outcome end to end."""
    job = _two_groups_and_a_spare_standing_by(local_job, max_restarts=0, lighthouse_process=True)
    pid = job.lighthouse_pid
    os.kill(pid, signal.SIGSTOP)
    paused = time.time()
    try:
        # Past the lighthouse's heartbeat timeout (2 s): the groups ride it out and go on committing.
        job.wait_until(lambda: all(any(e["committed"] and e["time"] > paused + 3 for e in job.steps(g))
                                   for g in (0, 1)), 60, "both groups to commit 3 s into the pause")
    finally:
        os.kill(pid, signal.SIGCONT)
    resumed = time.time()
    job.wait_until(lambda: all(any(e["committed"] and e["participants"] == 2 and e["time"] > resumed + 2
                                   for e in job.steps(g)) for g in (0, 1)), 60,
                   "both groups to commit together 2 s after the lighthouse resumed")
    joins = [e for e in [*job.events(), *job.spare_events()] if e.get("event") == "spare_join"]
    assert not joins, f"the spare joined a full job after the lighthouse's pause: {joins}"
    assert job.spares[0].proc.poll() is None, f"the spare left\n{job.tails()}"
    job.stop_soon()
    assert job.wait(timeout_s=120) == {0: 0, 1: 0}, job.tails()
    job.stop()
