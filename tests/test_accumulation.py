"""Every way DeepSpeed lets the caller end an optimizer step: one average and one vote per step, or a refusal.

Real single-rank DeepSpeed engines with a scripted manager that counts
``should_commit`` calls and cross-replica all-reduces (tests/fakes.py). The
multi-replica exactness of each pattern is the property test's job
(tests/integration/test_sync_property.py); here: the counts, the refusals and
their messages, and the window alignment on resume.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.fakes import tiny_engine

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("single_rank_world")]

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _engine(stage=2, gas=1, managed=True, overlap=False, mode="per_bucket"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    ds = {"gradient_accumulation_steps": gas, "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
          "zero_optimization": {"overlap_comm": overlap, "reduce_bucket_size": 20}}
    if not managed:
        ds["managed_gradient_accumulation"] = False
    return tiny_engine(stage, model=model, ds=ds, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                       ft={"sync_mode": mode, "cross_replica_bucket_bytes": 0})


def _loss(eng, i):
    g = torch.Generator().manual_seed(i)
    return eng(torch.randn(2, 4, generator=g)).pow(2).mean()


def _params(eng):
    return [p.detach().clone() for p in eng.adapter.full_parameters()]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_caller_set_boundary_votes_once_per_step_and_matches_managed(stage):
    manual = _engine(stage, gas=1)
    for s in range(2):
        for m in range(3):
            manual.set_gradient_accumulation_boundary(m == 2)
            manual.backward(_loss(manual, 10 * s + m))
        manual.step()
    assert manual.manager.calls == 2 and manual.global_steps == 2
    assert manual.sync.allreduces == 2 * len(manual.sync.plan)
    managed = _engine(stage, gas=3)
    for s in range(2):
        for m in range(3):
            managed.backward(_loss(managed, 10 * s + m) * 3)   # gas=3 divides the loss by 3; manual does not
            managed.step()
    assert managed.manager.calls == 2
    for a, b in zip(_params(manual), _params(managed)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_unmanaged_accumulation_votes_once_per_step(stage):
    eng = _engine(stage, managed=False)
    for s in range(2):
        for m in range(3):
            eng.backward(_loss(eng, 10 * s + m))
        eng.step()
    assert eng.manager.calls == 2 and eng.global_steps == 2
    assert eng.sync.allreduces == 2 * len(eng.sync.plan) and eng.sync.issued_in_backward == 0


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_coalesced_reduction_votes_once_per_step(stage):
    eng = _engine(stage)
    with eng.coalesce_grad_reduction():
        for m in range(3):
            eng.backward(_loss(eng, m))
    eng.step()
    assert eng.manager.calls == 1 and eng.global_steps == 1 and eng.sync.allreduces == len(eng.sync.plan)


def test_a_second_backward_at_the_boundary_is_refused():
    eng = _engine(2, gas=1)
    eng.backward(_loss(eng, 0))
    with pytest.raises(RuntimeError, match="set gradient_accumulation_steps=N and call step"):
        eng.backward(_loss(eng, 1))


@pytest.mark.parametrize("during_backward,before_step,match", [
    (False, True, "no backward of this step ran at the gradient accumulation boundary"),
    (True, False, "did not step the optimizer"),
])
def test_a_boundary_that_does_not_match_the_backward_is_refused(during_backward, before_step, match):
    eng = _engine(2, gas=1)
    eng.set_gradient_accumulation_boundary(during_backward)
    eng.backward(_loss(eng, 0))
    eng.set_gradient_accumulation_boundary(before_step)
    with pytest.raises(RuntimeError, match=match):
        eng.step()


def test_zero1_overlap_comm_with_accumulation_is_refused():
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2: ZeRO-1 with zero_optimization.overlap_comm"):
        _engine(1, gas=2, overlap=True)
    eng = _engine(1, gas=1, overlap=True)   # one backward per step: fine
    eng.backward(_loss(eng, 0))
    eng.step()
    eng.set_gradient_accumulation_boundary(False)        # accumulation driven by the caller: refused at once
    eng.backward(_loss(eng, 1))
    with pytest.raises(ValueError, match="Set overlap_comm to false"):
        eng.backward(_loss(eng, 2))


def test_windows_align_to_the_accumulation_count():
    from ftbridge.zero.engine_points import align_to_window

    assert [align_to_window(m, 4) for m in (0, 1, 4, 10, 12)] == [0, 4, 4, 12, 12]
    assert align_to_window(7, 1) == 7


def test_a_boundary_never_switched_on_warns(caplog):
    eng = _engine(2, gas=1)
    eng.set_gradient_accumulation_boundary(False)
    with caplog.at_level("WARNING"):
        for i in range(1000):
            eng.backward(_loss(eng, i))
            eng.step()              # DeepSpeed never steps: no boundary backward
    assert eng.global_steps == 0 and eng.manager.calls == 0
    assert "1000 backward calls without an optimizer step" in caplog.text
