"""Engine wrapper and ZeRO adapters on a real single-rank DeepSpeed engine (no network).

The torchft manager is replaced by a scripted stand-in (the manager is not
under test here; the multi-process tests use the real one), so commit,
discard and heal can be checked exactly, for ZeRO stages 1, 2 and 3.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.fakes import FakeManager

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("single_rank_world")]

os.environ.setdefault("DS_ACCELERATOR", "cpu")


BF16_OPT = "bf16-optimizer"
"""ZeRO-1 with bf16 parameters and fp32 gradient accumulation: DeepSpeed selects ``BF16_Optimizer``."""


def _engine(monkeypatch, stage, mode="per_bucket", gas=1, bucket_bytes=0, sgd=False, manager_cls=None):
    import deepspeed

    from ftbridge import engine as engine_mod
    from ftbridge.config import FTBridgeConfig
    from ftbridge.models import GPTConfig, build_model

    monkeypatch.setattr(engine_mod, "ReplicaManager", manager_cls or FakeManager)
    model = build_model(GPTConfig(vocab_size=17, context=16, n_layer=1, d_model=32, n_head=2), seed=3)
    bf16 = stage == BF16_OPT
    ds_config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "gradient_clipping": 1.0,
                 "steps_per_print": 10**9,
                 "zero_optimization": {"stage": 1 if bf16 else stage, "reduce_bucket_size": 3000},
                 "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 3}}}
    if sgd:
        ds_config["zero_allow_untested_optimizer"] = True
    if bf16:
        ds_config.update(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"})
    opt = (torch.optim.SGD if sgd else torch.optim.AdamW)(model.parameters(), lr=1e-2)
    raw, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
    if bf16:
        assert type(raw.optimizer).__name__ == "BF16_Optimizer"
    cfg = FTBridgeConfig.resolve(environ={}, sync_mode=mode, cross_replica_bucket_bytes=bucket_bytes)
    return engine_mod.FaultTolerantEngine(raw, cfg, checksum_every=0)


def _batch(i):
    g = torch.Generator().manual_seed(i)
    x = torch.randint(0, 17, (2, 16), generator=g)
    return x, torch.roll(x, -1, 1)


def _train(engine, batches, gas=1):
    for i in batches:
        for m in range(gas):
            _, loss = engine(*_batch(10 * i + m))
            engine.backward(loss)
            engine.step()


def _state(engine):
    from ftbridge.lm_job import final_digest

    return final_digest(engine.engine, engine.adapter), int(engine.global_steps), int(engine.micro_steps)


@pytest.mark.parametrize("stage", [1, 2, 3, BF16_OPT])
def test_discarded_step_changes_nothing(monkeypatch, stage):
    ref = _engine(monkeypatch, stage)
    _train(ref, [0, 2])
    eng = _engine(monkeypatch, stage)
    eng.manager.discard_calls = {2}          # the step on batch 1 is discarded
    _train(eng, [0, 1, 2])
    assert eng.last_committed is True
    (d_ref, steps_ref, _), (d, steps, _) = _state(ref), _state(eng)
    assert d == d_ref, "a discarded step changed parameters, optimizer state, lr or scheduler"
    assert steps == steps_ref == 2


@pytest.mark.parametrize("stage", [1, 2, 3, BF16_OPT])
def test_heal_state_round_trip_restores_everything(monkeypatch, stage):
    from ftbridge.transport import decode_state, encode_state

    donor = _engine(monkeypatch, stage)
    _train(donor, [0, 1, 2])
    donor._window_start = int(donor.micro_steps)  # as at the start of the donor's next step
    joiner = _engine(monkeypatch, stage)          # fresh: no optimizer state yet
    joiner.load_heal_state(decode_state(encode_state(donor.heal_state())))
    assert _state(joiner) == _state(donor)
    # Both train on identically from here.
    _train(donor, [3])
    _train(joiner, [3])
    assert _state(joiner) == _state(donor)


@pytest.mark.parametrize("stage,gas,expect_buckets", [(1, 1, True), (2, 1, True), (3, 1, True), (3, 2, True),
                                                       (2, 2, False)])
def test_per_bucket_hook_fires_per_bucket_once_per_step(monkeypatch, stage, gas, expect_buckets):
    eng = _engine(monkeypatch, stage, "per_bucket", gas)
    _train(eng, [0, 1], gas)
    per_step = eng.sync.allreduces / 2
    if expect_buckets:
        assert not eng.sync.fallback_reason
        assert per_step > 1, f"{per_step} all-reduces per step: the hook did not fire per bucket"
    else:
        assert "gradient_accumulation_steps" in eng.sync.fallback_reason
        assert per_step == 1
    # Whatever the mode, the whole partition went across replicas exactly once per step.
    post = _engine(monkeypatch, stage, "post_backward", gas)
    _train(post, [0, 1], gas)
    assert post.sync.allreduces == 2
    if stage == 3 or not expect_buckets:
        assert eng.sync.bytes_sent == post.sync.bytes_sent
    else:
        assert eng.sync.bytes_sent >= post.sync.bytes_sent   # edge parameters of the partition travel whole


class ZeroingManager(FakeManager):
    """A cross-replica 'average' that zeroes the gradient: shows whether the optimizer steps on it."""

    def allreduce(self, tensor, **kwargs):
        tensor.zero_()
        return super().allreduce(tensor, **kwargs)


@pytest.mark.parametrize("mode", ["per_bucket", "post_backward"])
@pytest.mark.parametrize("stage", [1, 2, 3, BF16_OPT])
def test_cross_replica_average_is_what_the_optimizer_steps_on(monkeypatch, stage, mode):
    plain = _engine(monkeypatch, stage, mode, sgd=True)
    before = _state(plain)[0]["params"]
    _train(plain, [0, 1, 2])              # WarmupLR: the first two steps have lr 0
    assert _state(plain)[0]["params"] != before, "SGD did not move the parameters at all"

    eng = _engine(monkeypatch, stage, mode, sgd=True, manager_cls=ZeroingManager)
    _train(eng, [0, 1, 2])
    assert eng.sync.allreduces >= 1
    assert _state(eng)[0]["params"] == before, "the optimizer stepped on a gradient the cross-replica sync did not touch"


@pytest.mark.parametrize("stage", [2, 3])
def test_buckets_are_coalesced_up_to_the_cross_replica_message_size(monkeypatch, stage):
    every = _engine(monkeypatch, stage, bucket_bytes=0)
    _train(every, [0])
    coalesced = _engine(monkeypatch, stage, bucket_bytes=12_000)
    _train(coalesced, [0])
    assert 1 < coalesced.sync.allreduces < every.sync.allreduces
    assert coalesced.sync.bytes_sent == every.sync.bytes_sent
    assert _state(coalesced) == _state(every)


def test_backward_without_forward_is_refused(monkeypatch):
    eng = _engine(monkeypatch, 2)
    with pytest.raises(RuntimeError, match="without a training forward"):
        eng.backward(torch.tensor(1.0, requires_grad=True))


@pytest.mark.parametrize("stage", [2, 3])
def test_optimizer_offload_is_refused_with_the_fix(monkeypatch, stage):
    import deepspeed

    from ftbridge.models import GPTConfig, build_model
    from ftbridge.zero.stages import adapter_for

    model = build_model(GPTConfig(vocab_size=17, context=16, n_layer=1, d_model=32, n_head=2), seed=3)
    ds_config = {"train_micro_batch_size_per_gpu": 2, "zero_force_ds_cpu_optimizer": False,
                 "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}}}
    raw, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                   config=ds_config)
    with pytest.raises(ValueError, match="remove offload_optimizer"):
        adapter_for(raw)
