"""FaultTolerantAccelerator end to end: 2 replica groups x 1 rank against plain Accelerate + DeepSpeed on 2 ranks.

The same script (``workers/accelerate_worker.py``: ZeRO-2 through Accelerate's ``DeepSpeedPlugin``, a shuffled
map-style loader, SGD with momentum, a warm-up ``LambdaLR``, no clipping) runs once as plain Accelerate under
torchrun and once under ftbridge (a lighthouse and one ``ftbridge-run`` per group, both groups in every
quorum); the two runs overlap in time. Group G must read exactly plain rank G's rows, see the same learning
rate after every step, and end with the plain run's parameters, while its model stays a ``DeepSpeedEngine``.
"""

from __future__ import annotations

import os

import pytest
import torch

from ftbridge.checkpoint import manifest
from tests.integration.hf_runs import run_ft_and_plain

pytest.importorskip("accelerate")

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "accelerate_worker.py")

ATOL = 1e-6
"""Parameters of the two runs may differ by the order of floating-point sums (2 ranks vs 2 groups)."""


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
