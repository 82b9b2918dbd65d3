"""Communication hooks inside a real single-rank DeepSpeed engine (ZeRO-1/2/3), scripted manager.

Checks the plumbing the in-process hook tests cannot: the fragment layout read
from DeepSpeed matches where each parameter's gradient sits in the partition,
the hook runs at the boundary, PowerSGD forces the post-backward path, its
state follows commit and discard, and it travels in the engine's heal state.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.distributed import ReduceOp

from tests.fakes import TINY_GPT, gpt_batch, tiny_engine

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("single_rank_world")]

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _engine(stage, hook="no", options=None, mode="per_bucket", bf16=False):
    from ftbridge.harness.models import GPTConfig, build_model

    model = build_model(GPTConfig(**TINY_GPT), seed=3)
    ds = {"ftbridge": {"comm_hook": hook, "sync_mode": mode, "cross_replica_bucket_bytes": 0,
                       **({"comm_state_option": options} if options else {})}}
    if bf16:
        model = model.to(torch.bfloat16)
        ds.update(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"})
    return tiny_engine(stage, model=model, ds=ds), model


def _train(engine, batches):
    for i in batches:
        _, loss = engine(*gpt_batch(i))
        engine.backward(loss)
        engine.step()


@pytest.mark.parametrize("stage,bf16", [(1, False), (2, False), (3, False), (2, True)])
def test_layout_matches_where_deepspeed_puts_each_gradient(stage, bf16):
    from ftbridge.harness.models import GPTConfig, build_model

    eng, _ = _engine(stage, "power_sgd", {"start_powerSGD_iter": 0}, bf16=bf16)
    ref = build_model(GPTConfig(vocab_size=17, context=16, n_layer=1, d_model=32, n_head=2), seed=3)
    if bf16:
        ref = ref.to(torch.bfloat16)
    x, y = gpt_batch(0)
    ref(x, y)[1].backward()
    ref_grads = [p.grad.float().reshape(-1) for p in ref.parameters()]
    _, loss = eng(x, y)
    eng.backward(loss)
    flat = torch.cat([t.reshape(-1).float() for t in eng.adapter.partition_grads()])
    layout = eng.sync.hook_state.layout
    assert layout.numel == flat.numel()
    by_shape = {}
    for g, p in zip(ref_grads, ref.parameters()):
        by_shape.setdefault(tuple(p.shape), []).append(g)
    covered = 0
    for f in layout.fragments:
        got = flat[f.offset:f.offset + f.numel]
        cands = [g[f.param_start:f.param_start + f.numel] for g in by_shape[f.shape]]
        assert any(torch.allclose(got, c, rtol=1e-2, atol=1e-5) for c in cands), f
        covered += f.numel
    assert covered == sum(p.numel() for p in ref.parameters())
    eng.step()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_powersgd_runs_post_backward_and_follows_commit_and_discard(stage):
    eng, _ = _engine(stage, "power_sgd", {"start_powerSGD_iter": 1, "matrix_approximation_rank": 2})
    assert "needs the whole partition" in eng.sync.fallback_reason
    state = eng.sync.hook_state
    _train(eng, [0])                                       # plain average
    assert state.iter == 1 and state.q is None
    assert eng.manager.ops[0][0] == eng.sync.hook_state.layout.numel
    _train(eng, [1, 2])                                    # PowerSGD: two messages per step
    assert state.iter == 3 and state.q is not None and state.error is not None
    assert len(eng.manager.ops) == 1 + 2 * 2
    plan = state.plan(state.layout.numel)
    assert eng.manager.ops[-2][0] == plan.plain_numel + plan.p_numel and eng.manager.ops[-1][0] == plan.q_numel
    assert plan.p_numel + plan.q_numel + plan.plain_numel < state.layout.numel / 2
    q, err = state.q.clone(), state.error.clone()
    eng.manager.discard_calls = {eng.manager.calls + 1}
    _train(eng, [3])
    assert eng.last_committed is False
    assert state.iter == 3 and torch.equal(state.q, q) and torch.equal(state.error, err)
    heal = eng.heal_state()["replica"]["extra"]["comm_hook"]
    assert heal["iter"] == 3 and torch.equal(heal["q"], q)


@pytest.mark.parametrize("hook", ["fp16", "bf16"])
def test_elementwise_hooks_run_per_bucket(hook):
    eng, _ = _engine(2, hook)
    assert not eng.sync.fallback_reason
    _train(eng, [0, 1])
    dtype = torch.float16 if hook == "fp16" else torch.bfloat16
    assert len(eng.manager.ops) > 2 and all(op[1] == dtype and op[2] == ReduceOp.SUM for op in eng.manager.ops)


def test_user_hook_is_called_with_the_managed_state():
    calls = []

    def my_hook(state, tensor):
        calls.append((tensor.numel(), state.participants))
        return state.allreduce(tensor)

    eng = tiny_engine(2, ft={"sync_mode": "post_backward"}, comm_hook=my_hook)
    _train(eng, [0])
    assert calls and calls[0][1] == 1 and eng.last_committed


@pytest.mark.parametrize("op,want", [(None, "mean"), ("mean", "mean"), ("sum", "sum")])
def test_the_hook_state_follows_the_engines_gradient_allreduce_op(op, want):
    # The cross-replica reduction must scale as the group's own does (end to end: test_sync_property).
    eng = tiny_engine(2, ds={} if op is None else {"gradient_allreduce_op": op})
    assert eng.sync.hook_state.reduction == want
