"""FaultTolerantAccelerator end to end: 2 replica groups x 1 rank against plain Accelerate + DeepSpeed on 2 ranks.

The same script (``workers/accelerate_worker.py``: ZeRO-2 through Accelerate's ``DeepSpeedPlugin``, a shuffled
map-style loader, SGD with momentum, a warm-up ``LambdaLR``, no clipping) runs once as plain Accelerate under
torchrun and once under ftbridge (a lighthouse and one ``ftbridge-run`` per group, both groups in every
quorum); the two runs overlap in time. Group G must read exactly plain rank G's rows, see the same learning
rate after every step, and end with the plain run's parameters, while its model stays a ``DeepSpeedEngine``.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from ftbridge.checkpoint import manifest
from ftbridge.harness import local_job as local_job_module
from tests.integration.hf_runs import run_ft_and_plain

pytest.importorskip("accelerate")

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "accelerate_worker.py")

ATOL = 1e-6
"""Parameters of the two runs may differ by the order of floating-point sums (2 ranks vs 2 groups)."""
SLOTS_ATOL = 2e-5
"""The same with slots, over about a thousand steps, most of them with one group summing both slots' units
(8.3e-7 measured after 806 steps; tests/integration/test_slots.py's tolerance)."""


def _run_both(local_job, tmp_path, extra=(), group_size=1):
    """The Accelerate worker as a fault-tolerant job of 2 groups and as plain DeepSpeed: ``(ft, plain)``."""
    return run_ft_and_plain(local_job, tmp_path, WORKER, extra, group_size)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage,gas,group_size", [
    (2, 1, 1),
    pytest.param(1, 2, 1, marks=pytest.mark.slow),
    pytest.param(3, 2, 1, marks=pytest.mark.slow),
    pytest.param(2, 2, 2, marks=pytest.mark.slow),  # Accelerate's own per-group shard, re-sharded; gloo in-group
    pytest.param(1, 2, 2, marks=pytest.mark.slow),  # accumulate() enters engine.no_sync() (ZeRO-1, group size > 1)
], ids=["zero2", "zero1-gas2", "zero3-gas2", "zero2-gas2-2x2", "zero1-gas2-2x2"])
def test_fault_tolerant_accelerate_trains_the_model_of_plain_accelerate(local_job, tmp_path, stage, gas, group_size):
    ft, plain = _run_both(local_job, tmp_path, ["--stage", str(stage), "--gas", str(gas), "--save-state"],
                          group_size)
    checkpoints = tmp_path / "ft" / "project" / "checkpoints"
    assert [ft[r]["saved"] for r in range(len(ft))] == [
        [str(checkpoints / "checkpoint_0"), str(checkpoints / "checkpoint_1")]] * group_size + [[None, None]] * (
        len(ft) - group_size), "replica group 0 writes, the others count the saves"
    assert os.listdir(checkpoints) == ["checkpoint_1"], "total_limit=1: the older one deleted after the seal"
    assert manifest.verify(str(checkpoints / "checkpoint_1")) == []
    assert all(r["reloaded"] for r in ft + plain), "load_state() restored the saved parameters on every rank"
    for r, (got, want) in enumerate(zip(ft, plain)):
        assert got["is_deepspeed_engine"], got["engine_type"]
        assert got["unwrapped_is_model"], "unwrap_model gives the user's model back"
        assert got["discarded"] == 0 and got["global_steps"] == want["global_steps"] > 0
        assert got["rows"] == want["rows"], f"data-parallel rank {r} reads plain rank {r}'s rows"
        assert got["lrs"] == pytest.approx(want["lrs"], rel=1e-12, abs=0), "the same learning rate every step"
    writers = [r for r in range(len(ft)) if ft[r]["params"]]  # under ZeRO-3 only a world's rank 0 gathers
    assert set(range(0, len(ft), group_size)) <= set(writers)
    for r in writers:
        assert ft[r]["state_dict_keys"] == ft[r]["model_keys"], "get_state_dict: the model's keys, no 'module.'"
        for name, want in plain[0]["params"].items():
            assert torch.equal(ft[r]["params"][name], ft[0]["params"][name]), f"groups differ in {name}"
            torch.testing.assert_close(ft[r]["params"][name], want, rtol=0, atol=ATOL, msg=name)
    moved = max((p - plain[0]["initial"][n]).abs().max().item() for n, p in plain[0]["params"].items())
    assert moved > 1000 * ATOL, f"training moved the parameters by {moved} only"
    assert plain[0]["lrs"][0] < plain[0]["lrs"][-1], "the schedule warms up: a step-count error would show"


@pytest.mark.slow  # a negative control: ~1 min
@pytest.mark.timeout(300)
def test_without_resharding_the_groups_train_another_model(local_job, tmp_path):
    ft, plain = _run_both(local_job, tmp_path, ["--no-shard"])
    assert ft[0]["rows"] == ft[1]["rows"], "every group reads the same rows"
    assert any((ft[0]["params"][n] - p).abs().max().item() > 100 * ATOL for n, p in plain[0]["params"].items())


@pytest.mark.slow  # a negative control: ~30 s
@pytest.mark.timeout(300)
def test_without_the_cross_replica_average_the_groups_train_apart(local_job, tmp_path):
    ft, plain = _run_both(local_job, tmp_path, ["--no-sync"])
    assert [r["rows"] for r in ft] == [r["rows"] for r in plain], "the rows of plain data parallelism"
    gap = max((ft[0]["params"][n] - ft[1]["params"][n]).abs().max().item() for n in ft[0]["params"])
    assert gap > 100 * ATOL, f"the groups hold one model without the cross-replica average ({gap})"


@pytest.mark.slow  # ~1.5 min: a job of 2 groups saves, then one of 3 loads
@pytest.mark.timeout(500)
def test_a_checkpoint_saved_by_2_groups_loads_into_3(local_job, tmp_path):
    """``save_state`` of a 2-group job (written by replica group 0, sealed), ``load_state`` of that folder in
    a 3-group job of the same group size: every group holds the saved parameters and step count."""
    env = {"OMP_NUM_THREADS": "1"}
    two, three = tmp_path / "two", tmp_path / "three"
    job = local_job(2, 1, ["--out", str(two), "--epochs", "1", "--save-state"], script=WORKER, min_replicas=2,
                    lighthouse_min_replicas=2, max_restarts=0, env=env)
    job.start()
    assert job.wait(timeout_s=240) == {0: 0, 1: 0}, job.tails()
    saved = torch.load(two / "result_0.pt")
    checkpoint = two / "project" / "checkpoints" / "checkpoint_1"
    assert manifest.verify(str(checkpoint)) == [] and saved["global_steps"] > 0
    job = local_job(3, 1, ["--out", str(three), "--epochs", "0", "--resume", str(checkpoint)], script=WORKER,
                    min_replicas=3, lighthouse_min_replicas=3, max_restarts=0, env=env)
    job.start()
    assert job.wait(timeout_s=240) == {0: 0, 1: 0, 2: 0}, job.tails()
    initial = saved["initial"]
    for r in range(3):
        got = torch.load(three / f"result_{r}.pt")
        assert got["global_steps"] == saved["global_steps"], f"group {r}: the saved step count"
        for name, want in saved["params"].items():
            assert torch.equal(got["params"][name], want), f"group {r} did not load {name}"
            assert not torch.equal(got["params"][name], initial[name]), "the saved model had trained"


@pytest.mark.timeout(400)
@pytest.mark.parametrize("slots", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["slots", "no-slots"])
def test_with_slots_a_group_alone_then_a_joiner_train_plain_accelerates_model(local_job, tmp_path, slots):
    """Slots under Accelerate (the worker's ``--slots`` loop over ``accelerator.units()``, ``FTBRIDGE_SLOTS=2``,
    2 micro-batches a step): group 0 trains alone first and computes both slots' units; group 1 joins by
    healing (that step is discarded everywhere and tried again), then each computes its own. Both end with
    plain Accelerate's parameters on 2 ranks after as many steps, and every committed step's learning rate is
    plain's. Without slots (the control) group 0 alone trained on half the rows: far from plain."""
    ft_out, plain_out = tmp_path / "ft", tmp_path / "plain"
    args = ["--slots", "--gas", "2"]
    job = local_job(2, 1, ["--out", str(ft_out), *args], script=WORKER, max_restarts=0,
                    env={"OMP_NUM_THREADS": "1", **({"FTBRIDGE_SLOTS": "2"} if slots else {})})
    job.script_args += ["--stop-file", f"{job.workdir}/stop"]
    job.start(groups=[0])
    job.wait_step(0, 5, timeout_s=120)
    started = time.time()
    job.start_group(1)
    job.wait_heal(1, started, 120, "group 1 to join by healing")
    healed = min(e["step"] for e in job.steps(1) if e["healed"] and e["time"] >= started)
    job.wait_step(1, healed + 3, timeout_s=60)
    target = job.stop_soon(5)
    assert job.wait(timeout_s=180) == {0: 0, 1: 0}, job.tails()
    local_job_module.run_plain_deepspeed(str(tmp_path), 2, ["--out", str(plain_out), *args, "--steps", str(target)],
                                         240, script=WORKER)
    ft = [torch.load(ft_out / f"result_{r}.pt") for r in (0, 1)]
    plain = torch.load(plain_out / "result_0.pt")
    assert ft[0]["global_steps"] == ft[1]["global_steps"] == plain["global_steps"] == target
    worst = max((ft[g]["params"][n] - p).abs().max().item() for g in (0, 1) for n, p in plain["params"].items())
    print(f"slots {slots}: healed at step {healed}, {target} steps, max |ft - plain| = {worst:.3g}")
    if not slots:
        assert worst > 100 * SLOTS_ATOL, f"without slots the job trained plain's model ({worst})"
        return
    assert worst <= SLOTS_ATOL, f"{worst} away from plain Accelerate after {target} steps"
    assert list(ft[0]["lrs"]) == list(range(1, target + 1)) == list(plain["lrs"])
    assert list(ft[0]["lrs"].values()) == pytest.approx(list(plain["lrs"].values()), rel=1e-12, abs=0)
    assert min(ft[1]["lrs"]) == healed + 1 and all(ft[1]["lrs"][s] == ft[0]["lrs"][s] for s in ft[1]["lrs"])
