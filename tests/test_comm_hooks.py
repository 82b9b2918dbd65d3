"""Communication hooks on an in-process fake of the managed cross-replica all-reduce.

:class:`FakeWorld` stands in for torchft's managed process group: one thread
per replica group calls the hook, ``allreduce`` sums across the threads (in
the payload dtype, like gloo), zeroes a healing replica's contribution and,
for ``AVG``, divides by the participants afterwards (torchft's order). It
counts nothing itself: bytes are counted by the hook state, which the tests
check against the expected factor.

Stated tolerances (also in docs/comm_hooks.md):

* ``no``: bit-identical to torchft's average (sum, then divide).
* ``fp16``: 40000 on every replica averages to exactly 40000 (divides before
  it casts); elementwise within 2^-10 relative of the mean magnitude.
* ``bf16``: elementwise within 2^-7 of the mean magnitude of the summands;
  training loss after 40 steps within 2 % of fp32.
* PowerSGD rank r: bytes per step = 4 * (uncompressed + sum (rows + cols) r);
  at full rank the average is exact to 1e-5; with error feedback the loss
  after 60 steps is within 10 % of no compression.
"""

from __future__ import annotations

from typing import Any, Callable, List, Sequence

import pytest
import torch

from ftbridge import comm_hooks
from ftbridge.comm_hooks import base, default
from ftbridge.comm_hooks.matrices import split
from ftbridge.zero.layout import Fragment, PartitionLayout, layout_from_shapes
from tests.fakes import FakeWorld, run_replicas

pytestmark = pytest.mark.timeout(120)


def run_hook(world: FakeWorld, hook: Callable, states: Sequence[Any], tensors: Sequence[torch.Tensor]) -> None:
    """Each replica runs ``hook`` on its tensor, concurrently, and waits for it."""
    out = run_replicas(world, lambda i: base.wait_result(hook(states[i], tensors[i]), tensors[i]))
    failures = [e for e in out if isinstance(e, BaseException)]
    if failures:
        raise failures[0]


def _grads(n: int, numel: int, seed: int = 0, scale: float = 1.0) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g) * scale for _ in range(n)]


# -- no / fp16 / bf16 -----------------------------------------------------------------------------

def test_no_hook_equals_plain_average_exactly():
    world = FakeWorld(3)
    grads = _grads(3, 1000)
    expected = (grads[0] + grads[1] + grads[2]) / 3
    tensors = [g.clone() for g in grads]
    hook, _ = comm_hooks.build("no", manager=None)
    states = [base.CommHookState(world.manager(i)) for i in range(3)]
    run_hook(world, hook, states, tensors)
    for t in tensors:
        assert torch.equal(t, expected)
    assert states[0].bytes_sent == 4000 and states[0].allreduces == 1


def test_every_reduction_divides_once_as_torchft_average_does():
    # The seam sums, then divides the result in place: bit-identical to torchft's AVG (sum, ``/= n``).
    world = FakeWorld(3, healing=(2,))
    grads = [g.bfloat16() for g in _grads(3, 999, seed=7)]
    tensors = [g.clone() for g in grads]
    run_hook(world, default.allreduce_hook, [base.CommHookState(world.manager(i)) for i in range(3)], tensors)
    summed = grads[0] + grads[1]  # replica 2 heals: zeros
    summed /= 2
    for t in tensors:
        assert torch.equal(t, summed)


@pytest.mark.parametrize("name", ["no", "fp16", "bf16", "power_sgd_full_rank"])
def test_a_summing_engine_gets_the_sum_across_groups(name):
    # DeepSpeed's gradient_allreduce_op=sum: each group holds its ranks' sum, and plain DeepSpeed sums over
    # every rank; an average here would halve the update on 2 groups while both commit.
    n, numel = 2, sum(torch.Size(s).numel() for s in SHAPES)
    world = FakeWorld(n)
    opts = {"matrix_approximation_rank": 64, "start_powerSGD_iter": 0, "min_compression_rate": 0.0,
            "use_error_feedback": False}
    kind, options = ("power_sgd", opts) if name.startswith("power_sgd") else (name, None)
    pairs = [comm_hooks.build(kind, "no", options, manager=world.manager(i), reduction="sum") for i in range(n)]
    for _, s in pairs:
        s.layout = layout_from_shapes(SHAPES)
    grads = _grads(n, numel, seed=4)
    tensors = [g.clone() for g in grads]
    run_hook(world, pairs[0][0], [s for _, s in pairs], tensors)
    exact = grads[0] + grads[1]
    if name in ("fp16", "bf16"):  # each addend and the sum rounded once: the bound of the averaging tests
        bound = {"fp16": 2 ** -10, "bf16": 2 ** -7}[name] * (grads[0].abs() + grads[1].abs()) + 1e-7
        assert ((tensors[0] - exact).abs() <= bound).all()
    else:
        tol = dict(rtol=0, atol=0) if name == "no" else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tensors[0], exact, **tol)
    assert torch.equal(tensors[0], tensors[1])


def test_an_unknown_reduction_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match="reduction='max'.*gradient_allreduce_op"):
        base.CommHookState(None, "max")


# -- a weight per group (label tokens of padded rows) ---------------------------------------------

@pytest.mark.parametrize("name", ["no", "fp16", "bf16"])
@pytest.mark.parametrize("healing", [(), (2,)])
def test_a_step_weight_gives_the_count_weighted_average(name, healing):
    # Each group's gradient is normalised by its own count (loss / count_g); plain data parallelism over the job
    # wants sum_g count_g * grad_g / sum_g count_g. A healing group's tensor and weight both count as zero.
    counts = [3.0, 17.0, 8.0]
    world = FakeWorld(3, healing)
    grads = _grads(3, 500, seed=3)
    live = [g for g in range(3) if g not in healing]
    expected = sum(counts[g] * grads[g] for g in live) / sum(counts[g] for g in live)
    hook, _ = comm_hooks.build(name, manager=None)
    states = [base.CommHookState(world.manager(i)) for i in range(3)]
    for state, count in zip(states, counts):
        state.set_weight(count)
    tensors = [g.clone() for g in grads]
    run_hook(world, hook, states, tensors)
    tol = {"no": 1e-6, "fp16": 2e-3, "bf16": 2e-2}[name]
    for t in tensors:
        torch.testing.assert_close(t, expected, rtol=0, atol=tol * expected.abs().max().item())
    unweighted = sum(grads[g] for g in live) / len(live)
    assert (expected - unweighted).abs().max() > 10 * tol * expected.abs().max(), "the weights must matter here"
    assert states[0].allreduces == 2, "one all-reduce of the weights per step, then the gradient"


def test_a_step_weight_lasts_one_step():
    world = FakeWorld(2)
    states = [base.CommHookState(world.manager(i)) for i in range(2)]
    for state, count in zip(states, (1.0, 3.0)):
        state.set_weight(count)
    grads = _grads(2, 100, seed=4)
    tensors = [g.clone() for g in grads]
    run_hook(world, default.allreduce_hook, states, tensors)
    torch.testing.assert_close(tensors[0], (grads[0] + 3 * grads[1]) / 4)
    for state in states:
        state.end_step()
    tensors = [g.clone() for g in grads]
    run_hook(world, default.allreduce_hook, states, tensors)
    assert torch.equal(tensors[0], (grads[0] + grads[1]) / 2), "the next step averages alike again"


def test_a_group_of_weight_zero_adds_nothing():
    world = FakeWorld(2)
    states = [base.CommHookState(world.manager(i)) for i in range(2)]
    states[0].set_weight(0)
    states[1].set_weight(5)
    grads = _grads(2, 100, seed=5)
    tensors = [g.clone() for g in grads]
    run_hook(world, default.allreduce_hook, states, tensors)
    torch.testing.assert_close(tensors[0], grads[1])


@pytest.mark.parametrize("weight, match", [(-1.0, "finite count >= 0"), (float("nan"), "finite"),
                                           (float("inf"), "finite"), ("3", "finite")])
def test_a_bad_step_weight_is_refused_naming_it(weight, match):
    with pytest.raises(ValueError, match=match):
        base.CommHookState(None).set_weight(weight)


def test_a_step_weight_is_refused_where_it_cannot_apply():
    with pytest.raises(ValueError, match="'sum'"):
        base.CommHookState(None, "sum").set_weight(2.0)
    _, state = comm_hooks.build("power_sgd", manager=None)
    with pytest.raises(ValueError, match="PowerSGD.*no hook, fp16 or bf16"):
        state.set_weight(2.0)


@pytest.mark.parametrize("n,healing", [(2, ()), (1, ()), (3, (2,))])
def test_fp16_divides_before_it_casts(n, healing):
    # 2 replicas, then the same job after one replica was lost (1 left), then a third joining (healing).
    world = FakeWorld(n, healing)
    tensors = [torch.full((64,), 40000.0) for _ in range(n)]
    states = [base.CommHookState(world.manager(i)) for i in range(n)]
    run_hook(world, default.fp16_compress_hook, states, tensors)
    for t in tensors:
        assert torch.isfinite(t).all()
        assert torch.equal(t, torch.full((64,), 40000.0)), t[:4]
    assert states[0].bytes_sent == 64 * 2


def test_fp16_average_close_to_fp32():
    world = FakeWorld(2)
    grads = _grads(2, 4096, seed=1)
    exact = (grads[0] + grads[1]) / 2
    tensors = [g.clone() for g in grads]
    run_hook(world, default.fp16_compress_hook, [base.CommHookState(world.manager(i)) for i in range(2)], tensors)
    bound = 2 ** -10 * (grads[0].abs() + grads[1].abs()) / 2 + 1e-7
    assert ((tensors[0] - exact).abs() <= bound).all()


def test_bf16_average_within_stated_tolerance():
    world = FakeWorld(2)
    grads = _grads(2, 4096, seed=2, scale=1e3)
    exact = (grads[0] + grads[1]) / 2
    tensors = [g.clone() for g in grads]
    states = [base.CommHookState(world.manager(i)) for i in range(2)]
    run_hook(world, default.bf16_compress_hook, states, tensors)
    bound = 2 ** -7 * (grads[0].abs() + grads[1].abs()) / 2
    assert ((tensors[0] - exact).abs() <= bound).all()
    assert torch.equal(tensors[0], tensors[1])
    assert states[0].bytes_sent == 4096 * 2


# -- a small data-parallel training run through the hooks -------------------------------------------

def _train(hook_name: str, steps: int, options=None, wrapper: str = "no", n: int = 2) -> float:
    """Train one small MLP as ``n`` data-parallel replicas averaging through the hook; final loss."""
    torch.manual_seed(0)
    w_true = torch.randn(32, 8)
    models = []
    for _ in range(n):
        torch.manual_seed(1)
        models.append(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8)))
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
    shapes = [tuple(p.shape) for p in models[0].parameters()]
    world = FakeWorld(n)
    states = []
    for i in range(n):
        hook, state = comm_hooks.build(hook_name, wrapper, options, manager=world.manager(i))
        state.layout = layout_from_shapes(shapes)
        states.append(state)
    data = torch.Generator().manual_seed(5)
    loss = torch.tensor(0.0)
    for step in range(steps):
        world.step = step
        flats = []
        for m in models:
            x = torch.randn(16, 32, generator=data)
            y = torch.tanh(x @ w_true)
            m.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            flats.append(torch.cat([p.grad.reshape(-1) for p in m.parameters()]))
        run_hook(world, hook, states, flats)
        for i, m in enumerate(models):
            states[i].commit()
            torch.nn.utils.vector_to_parameters(flats[i], [p.grad for p in m.parameters()])
            opts[i].step()
    for m in models[1:]:
        for a, b in zip(models[0].parameters(), m.parameters()):
            assert torch.equal(a, b), "replicas diverged"
    xv = torch.randn(256, 32, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        loss = torch.nn.functional.mse_loss(models[0](xv), torch.tanh(xv @ w_true))
    return float(loss), states


def test_bf16_training_matches_fp32_within_2_percent():
    ref, _ = _train("no", 40)
    bf16, _ = _train("bf16", 40)
    assert abs(bf16 - ref) <= 0.02 * ref, (bf16, ref)


def test_powersgd_with_error_feedback_loss_within_10_percent_of_no_compression():
    ref, _ = _train("no", 60)
    opts = {"matrix_approximation_rank": 2, "start_powerSGD_iter": 5}
    psgd, states = _train("power_sgd", 60, opts)
    assert abs(psgd - ref) <= 0.10 * ref, (psgd, ref)
    rate, before, after = states[0].compression_stats()
    assert rate > 3, rate
    wrapped, _ = _train("power_sgd", 60, opts, wrapper="fp16")
    assert abs(wrapped - ref) <= 0.10 * ref, (wrapped, ref)


# -- PowerSGD mechanics -------------------------------------------------------------------------

SHAPES = [(64, 32), (64,), (32, 48), (48,), (8, 4)]


def _psgd_world(n: int, options, healing=(), step: int = 10, batched: bool = False):
    world = FakeWorld(n, healing, step)
    name = "batched_power_sgd" if batched else "power_sgd"
    pairs = [comm_hooks.build(name, "no", options, manager=world.manager(i)) for i in range(n)]
    for _, s in pairs:
        s.layout = layout_from_shapes(SHAPES)
    return world, pairs[0][0], [s for _, s in pairs]


def test_powersgd_bytes_shrink_by_expected_factor():
    numel = sum(torch.Size(s).numel() for s in SHAPES)
    for r in (1, 2, 4):
        world, hook, states = _psgd_world(2, {"matrix_approximation_rank": r, "start_powerSGD_iter": 0})
        run_hook(world, hook, states, _grads(2, numel))
        # (64,32) and (32,48) compress; (8,4) only at r=1 ((8+4)*1*2 < 32); 1-D tensors go plain.
        small = 32 if r > 1 else (8 + 4) * r
        expected = 4 * (64 + 48 + small + (64 + 32) * r + (32 + 48) * r)
        assert states[0].bytes_sent == expected, (r, states[0].bytes_sent, expected)
        assert states[0].allreduces == 2
        print(f"rank {r}: {4 * numel} -> {expected} bytes, x{4 * numel / expected:.1f}")


def test_powersgd_at_full_rank_is_the_exact_average():
    numel = sum(torch.Size(s).numel() for s in SHAPES)
    opts = {"matrix_approximation_rank": 64, "start_powerSGD_iter": 0, "min_compression_rate": 0.0,
            "use_error_feedback": False}
    world, hook, states = _psgd_world(2, opts)
    grads = _grads(2, numel, seed=3)
    tensors = [g.clone() for g in grads]
    run_hook(world, hook, states, tensors)
    torch.testing.assert_close(tensors[0], (grads[0] + grads[1]) / 2, rtol=1e-5, atol=1e-5)
    assert torch.equal(tensors[0], tensors[1])


@pytest.mark.parametrize("batched", [False, True])
def test_powersgd_commit_discard_and_heal(batched):
    numel = sum(torch.Size(s).numel() for s in SHAPES)
    opts = {"matrix_approximation_rank": 2, "start_powerSGD_iter": 2}
    world, hook, states = _psgd_world(3, opts, step=0, batched=batched)
    # Steps 0, 1: plain averaging (exact), then PowerSGD; every replica identical after each step.
    for step in range(4):
        world.step = step
        tensors = _grads(3, numel, seed=step)
        exact = sum(tensors) / 3
        run_hook(world, hook, states, tensors)
        assert torch.equal(tensors[0], tensors[1]) and torch.equal(tensors[1], tensors[2])
        if step < 2:
            assert torch.equal(tensors[0], exact)
        for s in states:
            s.commit()
    assert [s.iter for s in states] == [4, 4, 4]
    assert all(torch.equal(s.q, states[0].q) for s in states)

    # A discarded step leaves Q, the error buffer and iter as they were.
    before = (states[0].iter, states[0].q.clone(), states[0].error.clone())
    world.step = 4
    run_hook(world, hook, states, _grads(3, numel, seed=40))
    for s in states:
        s.discard()
    assert states[0].iter == before[0] and torch.equal(states[0].q, before[1])
    assert torch.equal(states[0].error, before[2])

    # Replica 2 is replaced by a fresh joiner that heals during step 4: same message sizes (the phase
    # comes from the quorum's step), its contribution is zero, and it ends with its peers' Q and iter.
    world.healing = {2}
    joiner_hook, joiner = comm_hooks.build("batched_power_sgd" if batched else "power_sgd", "no", opts,
                                           manager=world.manager(2))
    joiner.layout = layout_from_shapes(SHAPES)
    states[2] = joiner
    tensors = _grads(3, numel, seed=41)
    run_hook(world, hook, states, tensors)
    joiner.load_state_dict(states[0].state_dict())   # the heal, applied in should_commit
    for s in states:
        s.commit()
    assert torch.equal(tensors[0], tensors[2]) and torch.equal(tensors[0], tensors[1])
    assert joiner.iter == states[0].iter == 5
    assert torch.equal(joiner.q, states[0].q)
    assert joiner.error is None and states[0].error is not None
    world.healing = set()
    world.step = 5
    tensors = _grads(3, numel, seed=50)
    run_hook(world, hook, states, tensors)
    assert torch.equal(tensors[0], tensors[2])


def test_powersgd_state_dict_round_trips_through_the_heal_wire_format():
    from ftbridge.manager.transport import decode_state, encode_state
    from ftbridge.zero.state import from_wire, to_wire

    world, hook, states = _psgd_world(1, {"start_powerSGD_iter": 0})
    fresh = comm_hooks.build("power_sgd", "no", {"start_powerSGD_iter": 0}, manager=world.manager(0))[1]
    fresh.layout = layout_from_shapes(SHAPES)
    run_hook(world, hook, states, _grads(1, sum(torch.Size(s).numel() for s in SHAPES)))
    states[0].commit()
    wire = decode_state(encode_state({"x": to_wire(states[0].state_dict())}))["x"]
    fresh.load_state_dict(from_wire(fresh.state_dict(), wire))
    assert fresh.iter == states[0].iter and torch.equal(fresh.q, states[0].q)


# -- fragments ------------------------------------------------------------------------------------

def test_fragment_whole_rows_compress_ragged_edges_go_plain():
    # A (100, 10) weight whose fragment starts 3 elements into row 2 and ends 5 elements into row 90.
    layout = PartitionLayout(1000, [Fragment(offset=7, numel=885, shape=(100, 10), param_start=23)])
    matrices, plain = split(layout, rank=1, min_compression_rate=2)
    assert len(matrices) == 1
    m = matrices[0]
    assert (m.offset, m.rows, m.cols) == (7 + 7, 87, 10)          # rows 3..89
    assert plain == [(7, 7), (7 + 7 + 870, 8)]
    # 1-D and too-small fragments are plain; padding (0..7, 892..1000) is in neither list.
    layout = PartitionLayout(30, [Fragment(0, 10, (10,)), Fragment(10, 20, (2, 10))])
    matrices, plain = split(layout, rank=1, min_compression_rate=2)
    assert matrices == [] and plain == [(0, 30)]


# -- configuration --------------------------------------------------------------------------------

def test_config_validation_names_value_and_fix():
    from ftbridge.config import FTBridgeConfig

    with pytest.raises(ValueError, match="comm_hook='powersgd'.*power_sgd"):
        FTBridgeConfig.resolve(environ={}, comm_hook="powersgd")
    with pytest.raises(ValueError, match="comm_wrapper='fp16' wraps a PowerSGD hook"):
        FTBridgeConfig.resolve(environ={}, comm_hook="fp16", comm_wrapper="fp16")
    with pytest.raises(ValueError, match="matrix_approximation_rnk"):
        FTBridgeConfig.resolve(environ={}, comm_hook="power_sgd", comm_state_option={"matrix_approximation_rnk": 2})
    with pytest.raises(ValueError, match="FTBRIDGE_COMM_STATE_OPTION"):
        FTBridgeConfig.resolve(environ={"FTBRIDGE_COMM_STATE_OPTION": "rank=2"})
    cfg = FTBridgeConfig.resolve(environ={"FTBRIDGE_COMM_HOOK": "POWER_SGD", "FTBRIDGE_COMM_WRAPPER": "bf16",
                                          "FTBRIDGE_COMM_STATE_OPTION": '{"matrix_approximation_rank": 4}'})
    hook, state = comm_hooks.build(cfg.comm_hook, cfg.comm_wrapper, cfg.comm_state_option)
    assert state.matrix_approximation_rank == 4 and state.start_powerSGD_iter == 1000
    assert "bf16_compress_wrapper(powerSGD_hook)" == hook.__name__


def test_deepspeed_config_section_is_stripped():
    from ftbridge.bootstrap import split_ds_config

    ds, section = split_ds_config({"zero_optimization": {"stage": 2},
                                   "ftbridge": {"comm_hook": "fp16"}})
    assert ds == {"zero_optimization": {"stage": 2}} and section == {"comm_hook": "fp16"}


def test_a_failing_hook_discards_the_step():
    from ftbridge.zero.grad_sync import GradientSync
    from ftbridge.zero.layout import layout_from_shapes

    class Adapter:
        on_cuda = False

        def side_streams(self):
            return []

        def partition_grads(self):
            return [torch.ones(8)]

        def partition_layout(self):
            return layout_from_shapes([(8,)])

        def grad_element_size(self):
            return 4

        def assemble_partition(self):
            pass

    world = FakeWorld(1)

    def broken(state, tensor):
        raise RuntimeError("boom")

    sync = GradientSync(world.manager(0), Adapter(), "post_backward", hook=broken)
    sync.install()
    sync.end_backward(boundary=True, no_sync=False)
    sync.wait()
    assert len(world.errors) == 1 and "boom" in str(world.errors[0])


def test_launcher_flags_become_ftbridge_variables(tmp_path):
    from tests.test_launcher import GROUP, build

    script = tmp_path / "train.py"
    script.write_text("")
    opts = '{"matrix_approximation_rank": 2}'
    _, env, _ = build([*GROUP, "--comm-hook", "power_sgd", "--comm-wrapper", "fp16", "--comm-state-option", opts,
                       "--", str(script)], environ={})
    assert (env["FTBRIDGE_COMM_HOOK"], env["FTBRIDGE_COMM_WRAPPER"], env["FTBRIDGE_COMM_STATE_OPTION"]) == \
        ("power_sgd", "fp16", opts)
    with pytest.raises(ValueError, match="comm_state_option.*--comm-state-option or FTBRIDGE_COMM_STATE_OPTION"):
        build([*GROUP, "--comm-hook", "power_sgd", "--comm-state-option", '{"rank": 2}', "--", str(script)],
              environ={})


def test_user_hook_can_ask_for_the_whole_partition():
    def my_hook(state, tensor):
        return state.allreduce(tensor)

    assert comm_hooks.build(my_hook)[1].needs_partition is False
    my_hook.needs_partition = True
    hook, state = comm_hooks.build(my_hook)
    assert hook is my_hook and state.needs_partition is True


@pytest.mark.parametrize("stage", [0, None])
def test_zero_stage_0_or_missing_is_refused_before_any_work(tmp_path, stage):
    import json

    import torch

    from ftbridge.bootstrap import initialize
    from ftbridge.config import FTBridgeConfig

    ds = {"train_micro_batch_size_per_gpu": 1, "ftbridge": {"comm_hook": "fp16"}}
    if stage is not None:
        ds["zero_optimization"] = {"stage": stage}
    path = tmp_path / "ds.json"  # a JSON path, as deepspeed.initialize accepts
    path.write_text(json.dumps(ds))
    with pytest.raises(ValueError, match=f"zero_optimization.stage={stage or 0}: set it to 1, 2 or 3"):
        initialize(model=torch.nn.Linear(2, 2), config=str(path), ft_config=FTBridgeConfig())


# -- lending and failed work --------------------------------------------------------------------

class _Failed:
    """A torchft work whose all-reduce failed: ``wait()`` is ``False``."""

    def wait(self, timeout: Any = None) -> bool:
        return False


class _LendingManager:
    participants = 2

    def __init__(self) -> None:
        self.lent: List[torch.Tensor] = []
        self.sent: List[torch.Tensor] = []

    def lend(self, tensor: torch.Tensor) -> None:
        self.lent.append(tensor)

    def allreduce(self, tensor: torch.Tensor, reduce_op: Any = None) -> Any:
        self.sent.append(tensor)
        return _Failed()


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_compress_hooks_lend_their_cast_and_a_failed_reduce_leaves_the_gradient_untouched(name):
    manager = _LendingManager()
    hook, state = comm_hooks.build(name, manager=manager)
    grad = torch.full((8,), 3.0)
    assert hook(state, grad).wait() is False
    assert manager.sent[0] is manager.lent[0] and manager.sent[0] is not grad  # the hook's own buffer
    torch.testing.assert_close(grad, torch.full((8,), 3.0))


def test_a_wrapper_lends_nothing_when_the_partition_already_has_the_payload_dtype():
    manager = _LendingManager()
    hook = default.fp16_compress_wrapper(default.allreduce_hook)
    grad = torch.ones(4, dtype=torch.float16)
    hook(base.CommHookState(manager), grad)
    assert manager.lent == []  # .to() returned the caller's tensor itself: it must not be reduced in place


def test_wait_result_reports_a_failed_work():
    assert base.wait_result(_Failed(), torch.zeros(1)) is False
