"""Failure-transparent training end to end: with slots, a job whose groups fail trains plain DeepSpeed's model.

Two replica groups of one rank, ZeRO-2, two micro-batches per slot, ``FTBRIDGE_SLOTS=2``, the main
job's scale-sensitive SGD (lr 1.0 would diverge over the hundreds of steps a restart takes; 0.05 does
not, and a wrong scale or a lost sample still moves the parameters far). Group 0 trains alone first
(it covers both slots), group 1 joins by healing (that step is discarded everywhere and tried again
with both), both train their own slot; in the full schedule (slow) group 1 is then killed (group 0
covers its slot again) and torchrun restarts it (a second heal). The job stops at one step. The final
parameters of both groups must equal those of plain DeepSpeed on 2 ranks with the same accumulation,
for the same number of steps, within the fp32 tolerance of the equivalence test (2.4e-7 was measured
after 393 steps of the full schedule). The full schedule without slots lands far outside it (3.2e-2).
"""

from __future__ import annotations

import time

import pytest
from safetensors.torch import load_file

from ftbridge.launch.processes import pid_alive
from tests.conftest import TINY, run_plain_deepspeed

ARGS = [*TINY, "--zero-stage", "2", "--grad-accum", "2", "--optimizer", "sgd", "--grad-clip", "0", "--lr", "0.05",
        "--dropout", "0.1"]
ATOL = 2e-5
"""fp32 tolerance of tests/integration/test_equivalence.py: the order of floating-point sums only."""


def _healed_at(job, group: int, since: float):
    return [e for e in job.steps(group) if e["healed"] and e["time"] >= since]


def _failing_run(local_job, tmp_path, slots: int, kill: bool = True):
    """The schedule of the module docstring (without the kill and restart unless ``kill``);
    returns ``(job, target step)``."""
    job = local_job(2, 1, [*ARGS, "--steps", "100000", "--save-params", str(tmp_path / "ft_{replica_group}.st")],
                    max_restarts=1, env={"FTBRIDGE_SLOTS": str(slots)})
    job.script_args += ["--stop-file", f"{job.workdir}/stop"]
    job.start(groups=[0])
    job.wait_step(0, 3, timeout_s=120)
    started = time.time()
    job.start_group(1)
    job.wait_until(lambda: _healed_at(job, 1, started), 120, "group 1 to join by healing")
    job.wait_step(1, _healed_at(job, 1, started)[0]["step"] + 3, timeout_s=60)
    if not kill:
        return _stop(job)
    killed = time.time()
    pids = job.kill_workers(1)
    assert not any(pid_alive(p) for p in pids)
    job.wait_until(lambda: _healed_at(job, 1, killed), 180, "group 1 to restart and heal")
    job.wait_step(1, _healed_at(job, 1, killed)[0]["step"] + 3, timeout_s=60)
    return _stop(job)


def _stop(job):
    target = job.stop_soon(5)
    codes = job.wait(timeout_s=180)
    assert codes == {0: 0, 1: 0}, job.tails()
    return job, target


def _plain(tmp_path, steps: int) -> dict:
    run_plain_deepspeed(tmp_path, 2, [*ARGS, "--steps", str(steps), "--save-params", str(tmp_path / "plain.st")])
    return load_file(str(tmp_path / "plain.st"))


def _worst(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kill", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["join", "join-kill-restart"])
def test_with_slots_failures_and_heals_train_plain_deepspeeds_model(local_job, tmp_path, kill):
    job, target = _failing_run(local_job, tmp_path, slots=2, kill=kill)
    plain = _plain(tmp_path, target)
    for g in (0, 1):
        worst = _worst(load_file(str(tmp_path / f"ft_{g}.st")), plain)
        assert worst <= ATOL, f"group {g} ended {worst} away from plain DeepSpeed after {target} steps"
    alone = [e for e in job.steps(0) if e["committed"] and e["participants"] == 1]
    together = [e for e in job.steps(0) if e["committed"] and e["participants"] == 2]
    assert alone and all(sorted(map(tuple, e["units"])) == [(0, 0), (0, 1), (1, 0), (1, 1)] for e in alone), (
        "group 0 alone did not cover both slots")
    assert together and all(e["units"] == [[0, 0], [0, 1]] for e in together)
    # Each heal step was discarded on both groups and tried again (no committed step holds a heal).
    heals = [e for e in job.steps(1) if e["healed"]]
    assert len(heals) == 1 + kill and not any(e["committed"] for e in heals)
    for e in heals:
        assert any(d["step"] == e["step"] and not d["committed"] for d in job.steps(0)), e
    assert [e["step"] for e in job.steps(0) if e["committed"]] == list(range(1, target + 1))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_without_slots_the_same_failures_change_the_model(local_job, tmp_path):
    job, target = _failing_run(local_job, tmp_path, slots=0)
    plain = _plain(tmp_path, target)
    worst = min(_worst(load_file(str(tmp_path / f"ft_{g}.st")), plain) for g in (0, 1))
    assert worst > 100 * ATOL, f"without slots the model stayed within {worst} of plain DeepSpeed"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_with_slots_a_warm_spare_takes_the_killed_groups_slot(local_job, tmp_path):
    job = local_job(2, 1, [*ARGS, "--steps", "100000", "--save-params", str(tmp_path / "ft_{replica_group}.st")],
                    max_restarts=1, env={"FTBRIDGE_SLOTS": "2", "FTBRIDGE_RESTART_PEER_WAIT_S": "3"})
    job.script_args += ["--stop-file", f"{job.workdir}/stop"]
    job.start()
    job.start_spare(0)
    job.wait_until(lambda: job.spare_ready(0), 120, "spare 0 to stand by")
    job.wait_until(lambda: all(any(e["committed"] and e["participants"] == 2 for e in job.steps(g)) for g in (0, 1)),
                   120, "both groups to commit together")
    killed = time.time()
    job.kill_workers(1)
    job.wait_until(lambda: any(e.get("event") == "spare_join" for e in job.events(1)), 60, "the spare to join")
    job.wait_until(lambda: _healed_at(job, 1, killed), 60, "the spare to heal as group 1")
    job.wait_step(1, _healed_at(job, 1, killed)[0]["step"] + 3, timeout_s=60)
    # group 1's torchrun restart stands by as spare index N + 1 = 3, under id N + 3 = 5 (ftbridge.spare)
    job.wait_until(lambda: any(e.get("event") == "spare_ready" for e in job.events(5, 0)), 120,
                   "group 1's torchrun restart to stand by as a spare")
    job, target = _stop(job)
    assert job.wait_spare(0, 120) == 0, job.tails()
    plain = _plain(tmp_path, target)
    for g in (0, 1):
        worst = _worst(load_file(str(tmp_path / f"ft_{g}.st")), plain)
        assert worst <= ATOL, f"group {g} ended {worst} away from plain DeepSpeed after {target} steps"
    spare_heals = [e for e in job.steps(1) if e["healed"] and e["time"] > killed]
    assert len(spare_heals) == 1 and not spare_heals[0]["committed"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_with_slots_a_resume_by_fewer_groups_continues_the_same_run(local_job, tmp_path):
    """Saved by 2 groups at step 4, resumed by 1 group (which then covers both slots) to step 8: plain
    DeepSpeed's 8 steps. A resume with other slots is refused before anything is loaded."""
    ckpt = str(tmp_path / "ckpt")
    common = [*ARGS, "--checkpoint-every", "4", "--keep-checkpoints", "0", "--checkpoint-dir", ckpt]
    saver = local_job(2, 1, [*common, "--steps", "4"], env={"FTBRIDGE_SLOTS": "2"})
    saver.start()
    assert saver.wait(timeout_s=180) == {0: 0, 1: 0}, saver.tails()
    resumed = local_job(1, 1, [*common, "--steps", "8", "--resume", "--save-params", str(tmp_path / "ft.st")],
                        env={"FTBRIDGE_SLOTS": "2"})
    resumed.start()
    assert resumed.wait(timeout_s=180) == {0: 0}, resumed.tails()
    assert [e["step"] for e in resumed.steps(0) if e["committed"]] == [5, 6, 7, 8]
    assert all(len(e["units"]) == 4 for e in resumed.steps(0))  # both slots' 2 micro-batches each
    worst = _worst(load_file(str(tmp_path / "ft.st")), _plain(tmp_path, 8))
    assert worst <= ATOL, f"the resumed run ended {worst} away from plain DeepSpeed after 8 steps"

    refused = local_job(1, 1, [*common, "--steps", "9", "--resume"], env={"FTBRIDGE_SLOTS": "3"})
    refused.start()
    assert refused.wait(timeout_s=120)[0] != 0
    log = refused.log_text(0)
    assert "was saved with slots=2, this job has slots=3" in log and "nothing was loaded" in log, refused.tails()
    assert not [e for e in refused.events() if e.get("event") in ("checkpoint_loaded", "resumed")]
    assert not refused.steps(0)
