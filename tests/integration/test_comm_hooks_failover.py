"""PowerSGD across a replica group's death and heal: identical replicas, shared PowerSGD state.

Two replica groups of two ranks train the tiny GPT with ZeRO-2 and PowerSGD
(rank 2, compression from step 3, error feedback, warm start). Group 1
joins by healing, is SIGKILLed, restarted by torchrun and heals again. Every
step committed by both groups has one parameter checksum; at the end every
rank has the same parameters, and for each group rank the PowerSGD
iteration and Q checksum are the same in both groups (the joiner received
them in its heal, its error-feedback buffer is local).
"""

from __future__ import annotations

import json
import time

import pytest

from ftbridge.launch.processes import pid_alive
from tests.conftest import TINY
from tests.integration.test_failover import _assert_commits_consistent, _assert_identical_finals, _finish

POWER_SGD = ["--comm-hook", "power_sgd", "--comm-state-option",
             json.dumps({"matrix_approximation_rank": 2, "start_powerSGD_iter": 3})]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_powersgd_group_killed_and_healed_ends_identical_with_shared_state(local_job):
    job = local_job(2, 2, [*TINY, "--steps", "100000", "--zero-stage", "2", *POWER_SGD], max_restarts=2)
    job.script_args += ["--stop-file", f"{job.workdir}/stop"]
    job.start(groups=[0])
    job.wait_step(0, 5, timeout_s=120)               # past start_powerSGD_iter: group 0 has a Q to send
    job.start_group(1)
    job.wait_until(lambda: any(e["healed"] for e in job.steps(1)), 120, "group 1 to join by healing")
    job.wait_step(1, job.max_step() + 3, timeout_s=120)
    kill_time = time.time()
    pids = job.kill_workers(1)
    assert not any(pid_alive(p) for p in pids)
    job.wait_heal(1, kill_time, 180, "restarted group 1 to heal")
    target = _finish(job, extra_steps=6)

    _assert_commits_consistent(job)
    _assert_identical_finals(job, target)
    finals = [e for e in job.events() if e.get("event") == "final"]
    for r in (0, 1):
        mine = [f for f in finals if f["group_rank"] == r]
        assert {f["comm_hook_iter"] for f in mine} == {target}, mine
        assert len({f["comm_hook_q_checksum"] for f in mine}) == 1 and mine[0]["comm_hook_q_checksum"], mine
        assert all(f["comm_hook_compression_rate"] > 2 for f in mine), mine
    starts = [e for e in job.events(1, 0) if e.get("event") == "start"]
    assert starts[-1]["sync_fallback"] and "whole partition" in starts[-1]["sync_fallback"]
