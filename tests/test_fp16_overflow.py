"""fp16 loss scaling: an overflow on any replica skips the step on every replica, and the scale moves alike.

The cross-replica average is what DeepSpeed's overflow check reads, so an inf
in any replica's gradient reaches every replica's check. Here one replica
group's gradient is finite and a stand-in manager "averages" in another
replica's inf: the step must be skipped (parameters unchanged), the loss scale
must drop, and the engine must not count it as a discarded (uncommitted)
step: every replica does the same thing with the same average, so it is
committed and skipped everywhere alike. Real single-rank DeepSpeed, ZeRO 1-3.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.fakes import FakeManager, gpt_batch, tiny_engine

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _fp16_supported() -> bool:
    # The accelerator's own answer, as deepspeed.initialize asks it (on CPU: oneDNN fp16, i.e. AVX-512 FP16
    # or AMX-FP16); without it DeepSpeed refuses fp16 configs outright.
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_fp16_supported())


pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("single_rank_world"),
              pytest.mark.skipif(not _fp16_supported(), reason="this device has no fp16 support in DeepSpeed's "
                                 "accelerator (CPU: needs AVX-512 FP16 or AMX-FP16)")]


class InfFromAnotherReplica(FakeManager):
    """Adds an inf into the 'average' at the second step's all-reduces (another replica overflowed)."""

    def allreduce(self, tensor, **kwargs):
        if self.calls == 1 and tensor.numel():
            tensor.view(-1)[0] = float("inf")
        return super().allreduce(tensor, **kwargs)


def _fp16_engine(stage, manager_cls):
    ds = {"fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1, "loss_scale_window": 1000}}
    return tiny_engine(stage, manager=manager_cls, ds=ds, ft={"cross_replica_bucket_bytes": 0})


def _step(engine, seed):
    _, loss = engine(*gpt_batch(seed))
    engine.backward(loss)
    engine.step()


def _params(engine):
    return [p.detach().float().clone() for p in engine.adapter.full_parameters()]


def _scale(engine):
    opt = engine.optimizer
    return float(getattr(opt, "cur_scale", None) or opt.loss_scaler.cur_scale)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_overflow_in_another_replica_skips_the_step_here_and_lowers_the_scale(stage):
    eng = _fp16_engine(stage, InfFromAnotherReplica)
    _step(eng, 0)                                  # a normal step
    before, scale, skipped = _params(eng), _scale(eng), int(eng.skipped_steps)
    _step(eng, 1)                                  # this replica's gradient is finite; the average is not
    assert eng.last_committed is True              # same average everywhere: committed (and skipped) alike
    assert int(eng.skipped_steps) == skipped + 1, "DeepSpeed did not see the overflow in the average"
    assert _scale(eng) == scale / 2
    for a, b in zip(before, _params(eng)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    _step(eng, 2)                                  # and training goes on
    assert int(eng.skipped_steps) == skipped + 1
    assert any(not torch.equal(a, b) for a, b in zip(before, _params(eng)))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_without_inf_in_the_average_fp16_steps_normally(stage):
    eng = _fp16_engine(stage, FakeManager)
    _step(eng, 0)
    scale = _scale(eng)
    _step(eng, 1)
    assert int(eng.skipped_steps) == 0 and _scale(eng) == scale
