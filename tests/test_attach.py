"""``ftbridge.attach``: ftbridge installed on a DeepSpeed engine someone else built (one real rank, no network).

The engine keeps its class, trains exactly as under ``ftbridge.initialize``'s wrapper, discards like it,
and its controller calls DeepSpeed's own methods (no recursion through the installed ones).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.fakes import FakeManager, gpt_batch, tiny_engine

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("single_rank_world")]

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def attached_engine(stage: int = 2, manager=FakeManager):
    """A real one-rank DeepSpeed engine built by ``deepspeed.initialize`` (as a framework would), then attached."""
    import deepspeed

    import ftbridge
    from ftbridge.config import FTBridgeConfig
    from ftbridge.harness.models import GPTConfig, build_model
    from tests.fakes import TINY_GPT

    model = build_model(GPTConfig(**TINY_GPT), seed=3)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "steps_per_print": 10**9,
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                      config=config)
    return ftbridge.attach(engine, ft_config=FTBridgeConfig.resolve(environ={}), checksum_every=0,
                           manager_factory=manager)


def _train(engine, batches):
    for i in batches:
        _, loss = engine(*gpt_batch(i))
        engine.backward(loss)
        engine.step()


def _params(engine):
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


@pytest.mark.parametrize("stage", [2, 3])
def test_the_engine_keeps_its_class_and_trains_exactly_as_the_wrapper(stage):
    import deepspeed

    from ftbridge.engine import FaultTolerantEngine

    attached = attached_engine(stage)
    wrapped = tiny_engine(stage)
    assert type(attached) is deepspeed.DeepSpeedEngine
    assert isinstance(attached.ftbridge, FaultTolerantEngine) and attached.ftbridge.engine is attached
    _train(attached, range(4))
    _train(wrapped, range(4))
    assert attached.global_steps == wrapped.global_steps == 4
    assert attached.ftbridge.manager.step == 4 and attached.ftbridge.last_committed is True
    got, want = _params(attached), _params(wrapped)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
    untrained = _params(tiny_engine(stage))
    assert any(not torch.equal(want[n], untrained[n]) for n in want), "training moved the parameters"


def test_a_discarded_step_leaves_the_model_and_the_counters():
    engine = attached_engine(2)
    engine.ftbridge.manager.discard_calls = {2}
    _train(engine, [0])
    before = _params(engine)
    _train(engine, [1])  # the manager's second vote: discarded on every replica
    assert engine.ftbridge.last_committed is False and not engine.was_step_applied()
    assert engine.global_steps == 1
    for name, p in _params(engine).items():
        assert torch.equal(p, before[name]), name
    _train(engine, [1])  # tried again: commits
    assert engine.ftbridge.last_committed is True and engine.global_steps == 2


def test_the_controller_calls_deepspeeds_own_methods_not_the_installed_ones():
    import deepspeed

    engine = attached_engine(2)
    ctl = engine.ftbridge
    assert engine.forward == ctl.forward and engine.backward == ctl.backward and engine.step == ctl.step
    assert ctl._ds_forward.__func__ is deepspeed.DeepSpeedEngine.forward
    assert ctl._ds_backward.__func__ is deepspeed.DeepSpeedEngine.backward
    assert ctl._ds_step.__func__ is deepspeed.DeepSpeedEngine.step
    assert ctl._ds_forward.__self__ is engine


def test_attach_refuses_a_second_attach_and_what_is_not_an_engine():
    import ftbridge

    engine = attached_engine(2)
    with pytest.raises(ValueError, match="already attached"):
        ftbridge.attach(engine, manager_factory=FakeManager)
    with pytest.raises(TypeError, match="DeepSpeedEngine"):
        ftbridge.attach(torch.nn.Linear(2, 2))
