"""The runnable examples, run as a user would: ``examples/minimal.py`` (docs/your-script.md) under two replica
groups, one of them killed and restarted partway; the Hugging Face examples (``hf_trainer.py``,
``hf_accelerate.py``) as local jobs whose groups end with one model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from ftbridge.launch.processes import pid_alive

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MINIMAL = os.path.join(ROOT, "examples", "minimal.py")


@pytest.mark.slow  # ~1 min: the survivor must still train when the restarted group is back (2000 steps)
@pytest.mark.timeout(300)
def test_the_minimal_script_survives_a_killed_group_and_ends_identical(local_job):
    job = local_job(2, 1, [], script=MINIMAL, max_restarts=1, env={"STEPS": "2000"})
    job.start()
    job.wait_until(lambda: any(e["committed"] and e["step"] >= 10 for e in job.steps(1)), 150,
                   "group 1 to commit step 10")
    killed = job.kill_workers(1)
    codes = job.wait(timeout_s=240)
    assert codes == {0: 0, 1: 0}, job.tails()
    assert not any(pid_alive(p) for p in killed)
    last = {g: [e for e in job.steps(g) if e["committed"]][-1] for g in (0, 1)}
    assert last[0]["step"] == last[1]["step"] == 2000, last
    assert last[0]["param_checksum"] == last[1]["param_checksum"], last
    assert any(e["healed"] for e in job.steps(1)), "the restarted group healed from the survivor"


@pytest.mark.timeout(420)
def test_the_minimal_script_runs_itself_as_a_local_job():
    # The script's own LocalJob waits at most 300 s and then ends every process it started; this bound is
    # longer, so that cleanup always runs first.
    out = subprocess.run([sys.executable, MINIMAL], check=False, capture_output=True, text=True, timeout=400,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("[replica")]
    assert [line.split(" loss")[0] for line in lines] == ["[replica 0 rank 0] step 60", "[replica 1 rank 0] step 60"]
    assert len({line.split(" params ")[1] for line in lines}) == 1, f"the groups hold different parameters: {lines}"


@pytest.mark.timeout(420)
@pytest.mark.parametrize("example,steps", [
    ("hf_trainer.py", 32),
    # CI runs hf_accelerate.py with a killed group (below) and minimal.py as a local job (above)
    pytest.param("hf_accelerate.py", 32, marks=pytest.mark.slow),
    ("hf_accelerate_slots.py", 16),
])
def test_a_hugging_face_example_runs_itself_as_a_local_job_and_its_groups_end_with_one_model(example, steps):
    pytest.importorskip("transformers")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", example)], check=False,
                         capture_output=True, text=True, timeout=400, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("[replica")]
    assert [line.split(" loss")[0] for line in lines] == [f"[replica {g} rank 0] step {steps}" for g in (0, 1)]
    checksums = {line.split(" params ")[1] for line in lines}
    assert len(checksums) == 1, f"the groups hold different parameters: {lines}"


@pytest.mark.timeout(420)  # ~1 min: the Accelerate path's kill and heal, in the default suite
def test_the_accelerate_example_heals_a_killed_group_which_reads_on_and_ends_with_the_same_model(local_job):
    """``examples/hf_accelerate.py`` loops on the engine's committed steps: group 1, SIGKILLed after step 10
    and restarted by torchrun (both groups needed for a quorum, so group 0 waits), heals, reads on at the
    step it joined and ends at step 32 with group 0's parameters."""
    pytest.importorskip("transformers")
    job = local_job(2, 1, [], script=os.path.join(ROOT, "examples", "hf_accelerate.py"), min_replicas=2,
                    lighthouse_min_replicas=2, max_restarts=1,
                    env={"OMP_NUM_THREADS": "1", "FTBRIDGE_QUORUM_TIMEOUT_S": "120"})
    job.start()
    job.wait_until(lambda: any(e["committed"] and e["step"] >= 10 for e in job.steps(1)), 240,
                   "group 1 to commit step 10")
    killed = job.kill_workers(1)
    assert job.wait(timeout_s=300) == {0: 0, 1: 0}, job.tails()
    assert not any(pid_alive(p) for p in killed)
    assert any(e["healed"] for e in job.steps(1)), "the restarted group healed from group 0"
    lines = [[line for line in job.log_text(g).splitlines() if line.startswith("[replica")][-1] for g in (0, 1)]
    assert [line.split(" loss")[0] for line in lines] == ["[replica 0 rank 0] step 32", "[replica 1 rank 0] step 32"]
    assert lines[0].split(" params ")[1] == lines[1].split(" params ")[1], lines


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_an_accelerate_group_that_heals_mid_step_ends_with_the_donors_random_state(local_job):
    """``examples/hf_accelerate.py`` (GPT-2 with dropout): group 1 is SIGSTOPped past the heartbeat timeout
    while group 0 trains on alone, then continued; it heals in a step whose forward ran on its own random
    state. At the end both groups hold one model and one random state: the heal step's end took the donor's
    generators as they stood at its commit vote (a heal alone leaves them one step behind). ``max_restarts=0``:
    both exiting 0 means group 1 came back by healing, not by a restart."""
    pytest.importorskip("transformers")
    # Enough steps that group 0 alone is still training when group 1, continued, gives up its frozen step
    # (the cross-replica timeout) and rejoins.
    job = local_job(2, 1, ["--epochs", "100"], script=os.path.join(ROOT, "examples", "hf_accelerate.py"),
                    max_restarts=0, env={"OMP_NUM_THREADS": "1", "FTBRIDGE_CROSS_REPLICA_TIMEOUT_S": "3"})
    job.start()
    job.wait_until(lambda: any(e["committed"] and e["participants"] == 2 for e in job.steps(1)), 240,
                   "both groups to commit together")
    pid = job.worker_pids(1)[0]
    t_stop = time.time()
    os.kill(pid, signal.SIGSTOP)
    try:
        job.wait_until(lambda: sum(e["committed"] and e["participants"] == 1 and e["time"] > t_stop
                                   for e in job.steps(0)) >= 3, 60, "group 0 to commit 3 steps alone")
    finally:
        os.kill(pid, signal.SIGCONT)
    job.wait_heal(1, t_stop, 120, "group 1 to heal from group 0")
    assert job.wait(timeout_s=300) == {0: 0, 1: 0}, job.tails()
    lines = [[line for line in job.log_text(g).splitlines() if line.startswith("[replica")][-1] for g in (0, 1)]
    assert lines[0].split(" loss")[0].split("] ")[1] == lines[1].split(" loss")[0].split("] ")[1], lines
    assert lines[0].split(" params ")[1] == lines[1].split(" params ")[1], lines
