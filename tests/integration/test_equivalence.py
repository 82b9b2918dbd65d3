"""ftbridge (2 replica groups x 2 ranks) against plain DeepSpeed data parallel on 4 ranks.

Same model, same seed, same global batch and data order (the batch is a pure
function of step and data-parallel rank). After several steps the parameters
must agree within a tolerance that only reflects the different order of
floating-point reductions (2-then-2 versus 4 ranks): fp32 atol 2e-5, bf16 atol 2e-2.

The comparison must be able to fail. The job's AdamW with gradient clipping
at 1.0 normalises the gradient's scale away (a sum instead of an average moved
the parameters about 5e-7), so the CI cases, and every bf16 case, train with
plain SGD, no clipping and a learning rate of 1.0 (``SCALE_SENSITIVE``): there
a sum across the two groups moved the parameters by 2.8, no cross-replica
all-reduce by 0.2, no training at all by 1.8, against 1.2e-7 for the real
sync (fp32, ZeRO-1). Every comparison checks that plain DeepSpeed's parameters
moved from their initial values by more than 10 x the tolerance (so "no
training" fails it), and ``test_negative_controls_fail_the_comparison`` (slow)
runs the missing all-reduce (``--no-cross-replica-sync``) and the missing
division (``--test-sync-sum``) and sees the comparison fail. The AdamW job
itself runs in the slow matrix.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import TINY, run_plain_deepspeed

STEPS = 6
SCALE_SENSITIVE = ["--optimizer", "sgd", "--grad-clip", "0", "--lr", "1.0"]
"""Plain SGD, no gradient clipping, a large learning rate: a wrong gradient scale moves the parameters."""

# (zero stage, grad accumulation, overlap_comm, bf16, sync mode, optimizer CPU offload, optimizer):
# CI runs these three (hook points: ZeRO-1/2 reduce_ipg_grads, ZeRO-3 partition_grads, ZeRO-1/2 offload's
# CPU partition; the post-backward fallback in test_slots.py), scale-sensitive; the rest is `-m slow`. ZeRO-3
# post-backward and BF16_Optimizer run in CI as single-rank engine tests (tests/test_engine.py) and here
# under `-m slow`. bf16 always trains scale-sensitive: with AdamW at 1e-3 its parameters moved less than
# its tolerance.
FAST = [
    (1, 1, False, False, "per_bucket", False, "sgd"),
    # ZeRO-2 with accumulation (messages after backward, see zero/grad_sync.py): the offload case below and
    # tests/integration/test_slots.py (G = 2, against plain DeepSpeed) in CI; overlap_comm under -m slow.
    (3, 1, False, False, "per_bucket", False, "sgd"),
    (2, 4, False, False, "per_bucket", True, "sgd"),   # offload: CPU accumulation, the CPU partition after backward
]
SLOW = [
    (stage, gas, overlap, bf16, mode, False, "sgd" if bf16 else "adamw")
    for stage in (1, 2, 3) for gas in (1, 4) for overlap in (False, True) for bf16 in (False, True)
    for mode in ("per_bucket", "post_backward")
    if not (stage == 1 and gas > 1 and overlap)  # refused: ZeroAdapter.accumulation_refused
] + [
    (stage, gas, overlap, False, "per_bucket", True, "adamw")
    for stage in (1, 2, 3) for gas in (1, 4) for overlap in (False, True)
    if not (stage == 1 and gas > 1 and overlap)
]
SLOW = [c for c in SLOW if c not in FAST]


def _args(stage: int, gas: int, overlap: bool, bf16: bool, offload: bool = False, optimizer: str = "adamw") -> list:
    # Small buckets: several reduced buckets per step, so the per-bucket hook really fires per bucket.
    args = [*TINY, "--steps", str(STEPS), "--zero-stage", str(stage), "--grad-accum", str(gas),
            "--reduce-bucket-size", "20000"]
    if optimizer == "sgd":
        args += SCALE_SENSITIVE
    if overlap:
        args.append("--overlap-comm")
    if bf16:
        args.append("--bf16")
    if offload:
        args.append("--offload-optimizer")
    return args


def _run_ftbridge(local_job, args, mode, extra=()):
    # One cross-replica message per DeepSpeed bucket: the hook's finest granularity.
    job = local_job(2, 2, [*args, *extra], min_replicas=2, lighthouse_min_replicas=2,
                    env={"FTBRIDGE_SYNC_MODE": mode, "FTBRIDGE_CROSS_REPLICA_BUCKET_BYTES": "0"})
    job.start()
    codes = job.wait(timeout_s=240)
    assert codes == {0: 0, 1: 0}, job.tails()
    return job


def _initial_params(bf16: bool) -> dict:
    """The parameters every run starts from (TINY model, the job's default seed), as saved (fp32)."""
    from ftbridge.harness.data import CharTokenizer, load_text
    from ftbridge.harness.models.char_gpt import GPTConfig, build_model

    flags = dict(zip(TINY[::2], TINY[1::2]))
    cfg = GPTConfig(vocab_size=CharTokenizer(load_text()).vocab_size, context=int(flags["--context"]),
                    n_layer=int(flags["--n-layer"]), n_head=int(flags["--n-head"]), d_model=int(flags["--d-model"]))
    model = build_model(cfg, seed=1234)
    if bf16:
        model = model.to(torch.bfloat16)
    return {n: p.detach().float() for n, p in model.named_parameters()}


def _worst(a: dict, b: dict) -> float:
    """Largest absolute difference over every parameter of ``a`` and ``b`` (same names)."""
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in b)


def _plain(tmp_path, args, bf16: bool) -> dict:
    """Plain DeepSpeed's final parameters; asserts they moved well beyond the tolerance (no-training fails)."""
    run_plain_deepspeed(tmp_path, 4, [*args, "--save-params", str(tmp_path / "plain.safetensors")])
    plain = load_file(str(tmp_path / "plain.safetensors"))
    moved = _worst(_initial_params(bf16), plain)
    assert moved > 10 * _atol(bf16), f"plain DeepSpeed moved the parameters only {moved}: the comparison cannot fail"
    return plain


def _atol(bf16: bool) -> float:
    return 2e-2 if bf16 else 2e-5


def _check(local_job, tmp_path, stage, gas, overlap, bf16, mode, offload, optimizer):
    args = _args(stage, gas, overlap, bf16, offload, optimizer)
    job = _run_ftbridge(local_job, args, mode, ["--save-params", str(tmp_path / "ft_{replica_group}.safetensors")])
    plain = _plain(tmp_path, args, bf16) if optimizer == "sgd" else load_plain(tmp_path, args)
    atol = _atol(bf16)
    for g in (0, 1):
        ft = load_file(str(tmp_path / f"ft_{g}.safetensors"))
        assert ft.keys() == plain.keys()
        for name in plain:
            torch.testing.assert_close(ft[name], plain[name], atol=atol, rtol=0,
                                       msg=lambda m: f"group {g} param {name}: {m}")
    finals = [e for e in job.events() if e.get("event") == "final"]
    per_step = {f["cross_replica_allreduces"] / STEPS for f in finals}
    overlapped = {f["cross_replica_messages_in_backward"] for f in finals}
    # bf16 under ZeRO-1/2 (BF16_Optimizer, the compact path) has no per-bucket point: one message after
    # backward. ZeRO-1/2 with accumulation send the same layout-fixed messages, after backward.
    # ZeRO-1/2 optimizer offload assemble the partition on the CPU: one message after backward too.
    one_message = stage in (1, 2) and (bf16 or offload)
    after_backward = stage in (1, 2) and gas > 1
    if mode == "per_bucket" and not one_message:
        assert min(per_step) > 1, f"per-bucket mode issued {per_step} all-reduces per step"
        if after_backward:
            assert overlapped == {0}, f"{overlapped} messages went inside backward, before the micro-steps were summed"
        else:
            assert min(overlapped) > 0, "no message overlapped backward: the bucket hook did not fire"
    else:
        assert per_step == {1}, f"post-backward mode issued {per_step} all-reduces per step"
    # No failures: every step of every rank committed, and the step counter equals the steps run.
    for g in (0, 1):
        for r in (0, 1):
            steps = job.steps(g, r)
            assert [e["step"] for e in steps] == list(range(1, STEPS + 1))
            assert all(e["committed"] and not e["healed"] and e["participants"] == 2 for e in steps)


def load_plain(tmp_path, args) -> dict:
    """Plain DeepSpeed's final parameters (AdamW job: its movement is not checked, see the module docstring)."""
    run_plain_deepspeed(tmp_path, 4, [*args, "--save-params", str(tmp_path / "plain.safetensors")])
    return load_file(str(tmp_path / "plain.safetensors"))


@pytest.mark.timeout(420)
@pytest.mark.parametrize("stage,gas,overlap,bf16,mode,offload,optimizer", FAST)
def test_matches_plain_deepspeed(local_job, tmp_path, stage, gas, overlap, bf16, mode, offload, optimizer):
    _check(local_job, tmp_path, stage, gas, overlap, bf16, mode, offload, optimizer)


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("stage,gas,overlap,bf16,mode,offload,optimizer", SLOW)
def test_matches_plain_deepspeed_full_matrix(local_job, tmp_path, stage, gas, overlap, bf16, mode, offload,
                                             optimizer):
    _check(local_job, tmp_path, stage, gas, overlap, bf16, mode, offload, optimizer)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_negative_controls_fail_the_comparison(local_job, tmp_path, bf16):
    # The scale-sensitive job with the sync broken on purpose: each must land well outside the tolerance.
    # bf16 syncs fp32 gradients (fp32 accumulation), so the sum reaches it too.
    args = _args(2, 1, False, bf16, optimizer="sgd")
    plain = _plain(tmp_path, args, bf16)
    for name, flag in (("no all-reduce", "--no-cross-replica-sync"), ("sum, no division", "--test-sync-sum")):
        out = tmp_path / name.replace(" ", "_").replace(",", "")
        _run_ftbridge(local_job, [*args, flag], "per_bucket", ["--save-params", str(out) + "_{replica_group}.st"])
        worst = min(_worst(load_file(f"{out}_{g}.st"), plain) for g in (0, 1))
        assert worst > 5 * _atol(bf16), f"{name}: within {worst} of plain DeepSpeed, the comparison cannot see it"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_without_cross_replica_sync_replicas_diverge(local_job, tmp_path):
    args = [*_args(2, 1, False, False), "--no-cross-replica-sync"]
    job = _run_ftbridge(local_job, args, "post_backward",
                        ["--save-params", str(tmp_path / "ft_{replica_group}.safetensors")])
    a = load_file(str(tmp_path / "ft_0.safetensors"))
    b = load_file(str(tmp_path / "ft_1.safetensors"))
    worst = max((a[n] - b[n]).abs().max().item() for n in a)
    assert worst > 1e-3, f"replica groups stayed equal ({worst}) without the cross-replica all-reduce"
    finals = {e["replica_group"]: e["param_checksum"] for e in job.events() if e.get("event") == "final"}
    assert finals[0] != finals[1]
