"""Engine wrapper and ZeRO adapters on a real single-rank DeepSpeed engine (no network).

The torchft manager is replaced by a scripted stand-in (the manager is not
under test here; the multi-process tests use the real one), so commit,
discard and heal can be checked exactly, for ZeRO stages 1, 2 and 3.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.fakes import FakeManager, gpt_batch, tiny_engine

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("single_rank_world")]

os.environ.setdefault("DS_ACCELERATOR", "cpu")


BF16_OPT = "bf16-optimizer"
"""ZeRO-1 with bf16 parameters and fp32 gradient accumulation: DeepSpeed selects ``BF16_Optimizer``."""

OFFLOAD = {"offload-1": (1, 1), "offload-2": (2, 1), "offload-3": (3, 1), "offload-2-gas2": (2, 2),
           "offload-3-gas2": (3, 2)}
"""ZeRO stage and gradient accumulation steps with ``offload_optimizer: {device: cpu}``."""


def _gas(stage):
    """Gradient accumulation steps a variant runs with (1 unless the variant names it)."""
    return OFFLOAD[stage][1] if stage in OFFLOAD else 1


def _engine(stage, mode="per_bucket", gas=None, bucket_bytes=0, sgd=False, manager_cls=None, checksum_every=0,
            ft=None):
    bf16 = stage == BF16_OPT
    offload = stage in OFFLOAD
    gas = gas or _gas(stage)
    zero_stage = 1 if bf16 else OFFLOAD[stage][0] if offload else stage
    ds = {"gradient_accumulation_steps": gas,
          "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 3}}}
    if offload:
        # A torch optimizer on the CPU (DeepSpeedCPUAdam would need its C++ extension built).
        ds.update(zero_optimization={"offload_optimizer": {"device": "cpu"}}, zero_force_ds_cpu_optimizer=False)
    if sgd:
        ds["zero_allow_untested_optimizer"] = True
    if bf16:
        ds.update(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"})
    eng = tiny_engine(zero_stage, manager=manager_cls, ds=ds, checksum_every=checksum_every,
                      optimizer=(lambda p: torch.optim.SGD(p, lr=1e-2)) if sgd else None,
                      ft={"sync_mode": mode, "cross_replica_bucket_bytes": bucket_bytes, **(ft or {})})
    if bf16:
        assert type(eng.engine.optimizer).__name__ == "BF16_Optimizer"
    if offload:
        assert eng.engine.zero_cpu_offload()
    return eng


def _train(engine, batches, gas=1):
    for i in batches:
        for m in range(gas):
            _, loss = engine(*gpt_batch(10 * i + m))
            engine.backward(loss)
            engine.step()


def _state(engine):
    from ftbridge.harness.lm_job import final_digest

    return final_digest(engine.engine, engine.adapter), int(engine.global_steps), int(engine.micro_steps)


def test_parameter_checksum_every_n_steps_from_the_config(tmp_path):
    log = tmp_path / "events.jsonl"
    eng = _engine(2, checksum_every=None, ft=dict(event_log=str(log), checksum_every=2))
    assert eng.checksum_every == 2
    _train(eng, range(5))
    eng.events.close()
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [e for e in steps if "committed" in e]
    assert [e["step"] for e in steps] == [1, 2, 3, 4, 5]
    assert [e["param_checksum"] is not None for e in steps] == [False, True, False, True, False]
    assert steps[1]["param_checksum"] != steps[3]["param_checksum"]


@pytest.mark.parametrize("stage", [1, 2, 3, BF16_OPT, *OFFLOAD])
def test_discarded_step_changes_nothing(stage):
    gas = _gas(stage)
    ref = _engine(stage)
    _train(ref, [0, 2], gas)
    eng = _engine(stage)
    eng.manager.discard_calls = {2}          # the step on batch 1 is discarded
    _train(eng, [0, 1, 2], gas)
    assert eng.last_committed is True
    (d_ref, steps_ref, _), (d, steps, _) = _state(ref), _state(eng)
    assert d == d_ref, "a discarded step changed parameters, optimizer state, lr or scheduler"
    assert steps == steps_ref == 2


@pytest.mark.parametrize("stage", ["offload-1", "offload-3"])
def test_discard_resets_what_offload_computed_in_backward(stage):
    # What step() resets itself: norms taken in backward (and, ZeRO-1/2, the overflow flag). A stale
    # local_overflow would make only this replica group skip its next committed step.
    eng = _engine(stage)
    eng.manager.discard_calls = {1}
    _, loss = eng(*gpt_batch(0))
    eng.backward(loss)
    opt = eng.adapter.optimizer
    assert opt.norm_for_param_grads, "offload took no per-parameter norms in backward"
    if hasattr(opt, "local_overflow"):        # ZeRO-1/2 only
        opt.local_overflow = True             # as if this discarded step had overflowed
    eng.step()
    assert eng.last_committed is False
    assert opt.norm_for_param_grads == {} and not getattr(opt, "local_overflow", False)


@pytest.mark.parametrize("stage", [1, 2, 3, BF16_OPT, *OFFLOAD])
def test_heal_state_round_trip_restores_everything(stage):
    from ftbridge.manager.transport import decode_state, encode_state

    gas = _gas(stage)
    donor = _engine(stage)
    _train(donor, [0, 1, 2], gas)
    donor._window_start = int(donor.micro_steps)  # as at the start of the donor's next step
    joiner = _engine(stage)          # fresh: no optimizer state yet
    joiner.load_heal_state(decode_state(encode_state(donor.heal_state())))
    assert _state(joiner) == _state(donor)
    # Both train on identically from here.
    _train(donor, [3], gas)
    _train(joiner, [3], gas)
    assert _state(joiner) == _state(donor)


class ConstantManager(FakeManager):
    """A cross-replica 'average' setting every gradient element to 0.1 (norm ~12: clipped), whatever was local."""

    def allreduce(self, tensor, **kwargs):
        tensor.fill_(0.1)
        return super().allreduce(tensor, **kwargs)


@pytest.mark.parametrize("stage", ["offload-1", "offload-2", "offload-3", "offload-2-gas2"])
def test_heal_in_should_commit_keeps_the_offloaded_gradient(stage):
    # torchft applies a heal inside should_commit: after backward, where under offload DeepSpeed has
    # already put the averaged gradient into the CPU fp32 partition and taken its norms. The joiner
    # computes its gradient on its own (stale) parameters; the average it received does not depend on
    # them, so it must step exactly like a replica that had the donor's state before backward.
    from ftbridge.manager.transport import decode_state, encode_state

    gas = _gas(stage)
    donor = _engine(stage, manager_cls=ConstantManager)
    _train(donor, [0, 1], gas)
    donor._window_start = int(donor.micro_steps)
    state = decode_state(encode_state(donor.heal_state()))

    healed_first = _engine(stage, manager_cls=ConstantManager)
    healed_first.load_heal_state(state)
    _train(healed_first, [5], gas)

    joiner = _engine(stage, manager_cls=ConstantManager)
    for m in range(gas):
        _, loss = joiner(*gpt_batch(50 + m))
        joiner.backward(loss)
        if m == gas - 1:
            joiner.load_heal_state(state)     # what should_commit does on a healing replica
        joiner.step()
    # Not bit-identical: AdamW's update rounds differently by up to 2e-9 after a load that follows a
    # backward (also without offload); a lost or stale gradient or norm moves parameters by ~lr = 6e-3.
    for got, want in zip(joiner.adapter.full_parameters(), healed_first.adapter.full_parameters()):
        torch.testing.assert_close(got, want, atol=1e-7, rtol=0)
    assert _state(joiner)[1:] == _state(healed_first)[1:]


@pytest.mark.parametrize("stage,gas,expect_buckets", [(1, 1, True), (2, 1, True), (3, 1, True), (3, 2, True),
                                                       (2, 2, False)])
def test_per_bucket_hook_fires_per_bucket_once_per_step(stage, gas, expect_buckets):
    eng = _engine(stage, "per_bucket", gas)
    _train(eng, [0, 1], gas)
    per_step = eng.sync.allreduces / 2
    assert not eng.sync.fallback_reason
    assert per_step == len(eng.sync.plan) > 1, f"{per_step} all-reduces per step, plan {len(eng.sync.plan)}"
    if expect_buckets:
        assert eng.sync.issued_in_backward > 0, "no message went out during backward: the hook did not fire"
    else:  # ZeRO-1/2 sum the micro-steps after the last bucket: the same messages go after backward
        assert eng.sync.issued_in_backward == 0
    # Whatever the mode, the whole partition went across replicas exactly once per step.
    post = _engine(stage, "post_backward", gas)
    _train(post, [0, 1], gas)
    assert post.sync.allreduces == 2
    assert eng.sync.bytes_sent == post.sync.bytes_sent
    assert _state(eng) == _state(post)


class ZeroingManager(FakeManager):
    """A cross-replica 'average' that zeroes the gradient: shows whether the optimizer steps on it."""

    def allreduce(self, tensor, **kwargs):
        tensor.zero_()
        return super().allreduce(tensor, **kwargs)


@pytest.mark.parametrize("stage,mode", [(s, m) for s in (1, 2, 3, BF16_OPT) for m in ("per_bucket", "post_backward")]
                         # under offload both modes take the same in-backward path (see the test below)
                         + [(s, "per_bucket") for s in OFFLOAD])
def test_cross_replica_average_is_what_the_optimizer_steps_on(stage, mode):
    gas = _gas(stage)
    plain = _engine(stage, mode, sgd=True)
    before = _state(plain)[0]["params"]
    _train(plain, [0, 1, 2], gas)         # WarmupLR: the first two steps have lr 0
    assert _state(plain)[0]["params"] != before, "SGD did not move the parameters at all"

    eng = _engine(stage, mode, sgd=True, manager_cls=ZeroingManager)
    _train(eng, [0, 1, 2], gas)
    assert eng.sync.allreduces >= 1
    assert _state(eng)[0]["params"] == before, \
        "the optimizer stepped on a gradient the cross-replica sync did not touch"


class ScalingManager(FakeManager):
    """A cross-replica 'average' that multiplies the gradient by 1000: far past the clip norm of 1.0."""

    def allreduce(self, tensor, **kwargs):
        tensor.mul_(1000.0)
        return super().allreduce(tensor, **kwargs)


@pytest.mark.parametrize("stage", list(OFFLOAD))
def test_offload_clips_by_the_cross_replica_norm(stage):
    # DeepSpeed takes the offload path's per-parameter norms in backward. Synced too late, the clip
    # coefficient would come from the local gradient and the step would be 1000x too long. The
    # reference is the same stage without offload, whose sync runs before step() takes the norm.
    zero_stage, gas = OFFLOAD[stage]
    ref = _engine(zero_stage, gas=gas, sgd=True, manager_cls=ScalingManager)
    _train(ref, [0, 1, 2, 3], gas)
    eng = _engine(stage, sgd=True, manager_cls=ScalingManager)
    _train(eng, [0, 1, 2, 3], gas)
    for got, want in zip(eng.adapter.full_parameters(), ref.adapter.full_parameters()):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("stage", [2, 3])
def test_buckets_are_coalesced_up_to_the_cross_replica_message_size(stage):
    every = _engine(stage, bucket_bytes=0)
    _train(every, [0])
    coalesced = _engine(stage, bucket_bytes=12_000)
    _train(coalesced, [0])
    assert 1 < coalesced.sync.allreduces < every.sync.allreduces
    assert coalesced.sync.bytes_sent == every.sync.bytes_sent
    assert _state(coalesced) == _state(every)


def test_backward_without_forward_is_refused():
    eng = _engine(2)
    with pytest.raises(RuntimeError, match="without a training forward"):
        eng.backward(torch.tensor(1.0, requires_grad=True))


@pytest.mark.parametrize("stage,in_backward", [("offload-1", False), ("offload-2", False), ("offload-3", True)])
def test_optimizer_offload_sends_the_layout_fixed_partition_once_per_step(stage, in_backward):
    # ZeRO-1/2 offload assemble the partition on the CPU: its messages go after backward. ZeRO-3 keeps
    # its per-bucket messages in backward (grad_partitions_flat_buffer, as without offload).
    eng = _engine(stage, "per_bucket")
    assert eng.adapter.offload
    _train(eng, [0, 1])
    post = _engine(stage, "post_backward")
    _train(post, [0, 1])
    assert (eng.sync.issued_in_backward > 0) == in_backward
    assert bool(eng.sync.fallback_reason) != in_backward
    assert eng.sync.bytes_sent == post.sync.bytes_sent > 0
    assert _state(eng) == _state(post)


def _offload_engine(ds_extra, model_dtype=None, **ft):
    from ftbridge.harness.models import GPTConfig, build_model
    from tests.fakes import TINY_GPT

    model = build_model(GPTConfig(**TINY_GPT), seed=3)
    if model_dtype is not None:
        model = model.to(model_dtype)
    ds = {"zero_force_ds_cpu_optimizer": False, "zero_optimization": {"offload_optimizer": {"device": "cpu"}},
          **ds_extra}
    return lambda: tiny_engine(2, ds=ds, model=model, ft=ft)


def test_optimizer_offload_refuses_the_compact_fp32_gradient_path():
    build = _offload_engine({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}},
                            model_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="remove offload_optimizer"):
        build()


def test_optimizer_offload_runs_power_sgd_on_the_cpu_partition():
    eng = _offload_engine({}, comm_hook="power_sgd")()
    for i in range(2):
        _, loss = eng(*gpt_batch(i))
        eng.backward(loss)
        eng.step()
    assert eng.last_committed and eng.sync.allreduces >= 2


def test_exposed_cross_replica_wait_is_summed_over_steps(monkeypatch):
    import types

    from ftbridge import engine as engine_mod

    eng = _engine(2, "post_backward")
    clock = [100.0]
    real_wait = eng.sync.wait

    def slow_wait():  # the all-reduce takes 0.25 s of a fake clock past the end of backward
        clock[0] += 0.25
        real_wait()

    monkeypatch.setattr(eng.sync, "wait", slow_wait)
    monkeypatch.setattr(engine_mod, "time", types.SimpleNamespace(time=engine_mod.time.time,
                                                                  perf_counter=lambda: clock[0]))
    _train(eng, range(3))
    assert eng.cross_replica_wait_s == pytest.approx(0.75)


@pytest.mark.parametrize("stage", [1, 2, 3, BF16_OPT, "offload-2", "offload-3"])
def test_the_guard_fingerprints_every_master_weight_and_its_optimizer_state(stage):
    # ZeRO-3 keeps its fp32 partitions out of the torch optimizer's param_groups between steps: a
    # fingerprint read from there was empty, and the divergence guard compared nothing.
    from ftbridge.events import tensor_checksum

    eng = _engine(stage)
    _train(eng, [0, 1, 2], _gas(stage))
    tensors = eng.adapter.fingerprint_tensors()
    n_params = sum(p.numel() for p in eng.module.parameters() if p.requires_grad) if stage != 3 else \
        sum(p.ds_numel for p in eng.module.parameters())
    assert sum(t.numel() for t in tensors) >= 3 * n_params, "master weights and AdamW's two moments"
    before = tensor_checksum(tensors)
    tensors[0].view(-1)[0] += 1e-3                 # one master element of this replica drifts
    assert tensor_checksum(eng.adapter.fingerprint_tensors()) != before



@pytest.mark.parametrize("heal_retried", [True, False])
def test_a_restart_without_peer_is_judged_on_the_first_committed_step(monkeypatch, tmp_path, heal_retried):
    # A restarted group whose first heal failed (one rank's donor died) discards that step at step 0; the
    # retry heals it. Only a first *committed* step with no heal means it trained from the initial model.
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    log = tmp_path / "events.jsonl"
    eng = _engine(2, ft=dict(event_log=str(log)))
    eng.manager.discard_calls = {1}
    _train(eng, [0])
    if heal_retried:
        eng.manager.heals, eng.manager.step = 1, 693
    _train(eng, [1])
    eng.events.close()
    events = [json.loads(line) for line in log.read_text().splitlines()]
    lonely = [e for e in events if e.get("event") == "restart_without_peer"]
    assert [e["committed"] for e in events if "committed" in e] == [False, True]
    assert len(lonely) == (0 if heal_retried else 1), lonely


@pytest.mark.parametrize("joined", ["restart", "spare"])
def test_a_group_that_joined_empty_alone_past_the_wait_stops_instead_of_training_a_second_model(
        monkeypatch, tmp_path, joined):
    # A torchrun restart, or a warm spare that took a vacant group's id (its first launch): neither holds state.
    from ftbridge.heal import NoPeerToHealFrom

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1" if joined == "restart" else "0")
    log = tmp_path / "events.jsonl"
    eng = _engine(2, ft=dict(event_log=str(log), num_replica_groups=2, restart_peer_wait=3600.0,
                             spare_index=0 if joined == "spare" else -1))
    _train(eng, [0])                                    # alone at step 0: discarded while a peer may come
    assert eng.manager.step == 0 and eng.last_committed is False
    eng._launched -= 3600.0                             # the wait is over and still nobody to heal from
    with pytest.raises(NoPeerToHealFrom, match="does not train alone from step 0"):
        _train(eng, [1])
    eng.events.close()
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert [e for e in events if e.get("event") == "restart_without_peer"][0]["stopped"]
    assert not any(e.get("committed") for e in events)
