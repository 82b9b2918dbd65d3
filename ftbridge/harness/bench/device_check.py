"""The device check (``scripts/device_check.sh``): ftbridge on one GPU, end to end, in minutes.

Three parts, each a set of rows of one table (printed, and written as text
and JSON):

* ``equivalence``: 2 replica groups x 1 rank on the GPU against plain
  DeepSpeed, ZeRO 1, 2 and 3, fp32 and bf16, ``overlap_comm`` off and on:
  max |difference| of the final parameters (group 0 against the baseline),
  and whether the two groups ended bit-identical. Both groups share the one
  GPU, so the cross-replica group is gloo with CUDA tensors
  (:mod:`ftbridge.device`), and the baseline is plain DeepSpeed on one rank
  training on the same global batch (``train_lm.py --plain --plain-global-of 2``):
  two plain ranks cannot share a GPU under NCCL.
* ``extras``: the same against plain DeepSpeed with optimizer offload, with
  asynchronous checkpoints (verified), and with compressed all-reduces
  (bf16 hook, PowerSGD: only the groups must end identical).
* ``failover``: group 1 is SIGKILLed, restarted by torchrun and heals from
  group 0 on the GPU (through the pinned staging buffer): the survivor's
  stall, the heal time by phase (:func:`ftbridge.harness.bench.heal.heal_phases`),
  and the heal's transfer rate against a plain device-to-host-to-device copy
  of the same bytes measured in this process.
* ``overhead``: median step time of ftbridge (2 x 1) against the baseline at
  a model size where the GPU is busy, and the exposed cross-replica wait
  (GPU time the training stream stalled on the all-reduce,
  ``--time-cross-replica-wait``).

``--dry-run`` runs the same code on the CPU with gloo and small sizes
(``--device cpu``), so the script itself is tested without a GPU.

Usage::

    python -m ftbridge.harness.bench.device_check [--dry-run] [--only equivalence,extras,failover,overhead]
        [--out runs/device_check] [--stages 1,2,3] [--failover-model small|big]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

PARTS = ("equivalence", "extras", "failover", "overhead")
TOLERANCE = {"fp32": 1e-4, "bf16": 1e-2}
"""Largest |difference| to plain DeepSpeed counted as equivalent. fp32: a missing cross-replica sync moves
parameters by about the learning rate, 1e-3, per step (dry run measured 3.7e-9 when right). bf16: a few
units in the last place of bf16 parameters (dry run: 6e-5 to 2.4e-4); there a broken sync shows in
``replicas_equal`` (the groups diverge) rather than in this difference."""


@dataclass
class Plan:
    """Sizes and settings of one check; :func:`make_plan` picks them for a GPU or a dry run."""

    device: str
    equivalence_steps: int
    model: Dict[str, int]
    stages: Sequence[int] = (1, 2, 3)
    dtypes: Sequence[str] = ("fp32", "bf16")
    overlaps: Sequence[bool] = (False, True)
    big_model: Dict[str, int] = field(default_factory=dict)
    overhead_steps: int = 20
    overhead_warmup: int = 5
    timeout_s: float = 300.0
    message_bytes: int = 1 << 20
    """``FTBRIDGE_CROSS_REPLICA_BUCKET_BYTES`` of the equivalence runs: small, so per-bucket sync sends many
    messages during backward (the stream ordering under test)."""
    parallel: int = 1
    """Equivalence configurations run at once (one GPU has room for several small jobs)."""
    failover_big: bool = False
    """The failover part heals the overhead's big model (``big_model``, bf16) instead of ``model``: a state
    of gigabytes, so the transfer rate is a throughput rather than a few round trips."""


def make_plan(dry_run: bool, stages: Sequence[int] = (1, 2, 3)) -> Plan:
    """The GPU plan (about 4 minutes on an H200) or the CPU dry run's (small sizes).

    The overhead model: 24 layers of d_model 1024 (302 M parameters, bf16) on the GPU, so one step
    keeps the GPU busy; 2 layers of 64 in the dry run.
    """
    if dry_run:
        small = {"n_layer": 2, "d_model": 32, "n_head": 2, "context": 16, "micro_batch": 2}
        return Plan("cpu", 3, small, stages=stages, big_model={**small, "d_model": 64}, overhead_steps=6,
                    overhead_warmup=2, timeout_s=180.0, message_bytes=16 << 10, parallel=1)
    return Plan("cuda", 6, {"n_layer": 4, "d_model": 256, "n_head": 4, "context": 128, "micro_batch": 8},
                stages=stages, big_model={"n_layer": 24, "d_model": 1024, "n_head": 16, "context": 256,
                                          "micro_batch": 8}, overhead_steps=20, overhead_warmup=5, timeout_s=300.0,
                message_bytes=1 << 20, parallel=3)


def model_flags(model: Dict[str, int]) -> List[str]:
    """``train_lm.py`` flags of ``model``."""
    return [f for k, v in model.items() for f in (f"--{k.replace('_', '-')}", str(v))]


def max_abs_diff(a: Dict[str, Any], b: Dict[str, Any]) -> float:
    """Largest |a - b| over the tensors of two parameter dicts (same names and shapes), as float64.

    Raises:
        ValueError: the names or shapes differ.
    """
    if a.keys() != b.keys():
        raise ValueError(f"parameter names differ: {sorted(set(a) ^ set(b))[:5]}")
    worst = 0.0
    for k in a:
        if a[k].shape != b[k].shape:
            raise ValueError(f"parameter {k}: shape {tuple(a[k].shape)} != {tuple(b[k].shape)}")
        if a[k].numel():
            worst = max(worst, float((a[k].double() - b[k].double()).abs().max()))
    return worst


def _load(path: str) -> Dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(path)


def equivalence_row(workdir: str, plan: Plan, stage: int, dtype: str, overlap: bool,
                    extra: Sequence[str] = (), name: str = "", exact: bool = True) -> Dict[str, Any]:
    """One equivalence configuration: ftbridge 2 x 1 and the plain baseline, run at the same time.

    ``extra``: more ``train_lm.py`` flags of the ftbridge run (an extras row); ``exact`` False (a compressed
    all-reduce) asks only that both groups end identical, the difference to the baseline is reported.
    """
    from ftbridge.harness.bench.jobs import run_ftbridge, run_plain

    name = name or f"z{stage}_{dtype}_{'overlap' if overlap else 'serial'}"
    # lr 1e-3 from the first step (no warm-up): a missing or wrong cross-replica sync moves the parameters
    # by about that much per step, far above TOLERANCE.
    args = ["--device", plan.device, "--steps", str(plan.equivalence_steps), "--zero-stage", str(stage),
            "--val-every", "0", "--val-batches", "1", "--reduce-bucket-size", "20000", "--warmup-steps", "1",
            *model_flags(plan.model)]
    args += (["--bf16"] if dtype == "bf16" else []) + (["--overlap-comm"] if overlap else [])
    ft_dir, plain_dir = os.path.join(workdir, name, "ftbridge"), os.path.join(workdir, name, "plain")
    extra = [a.replace("{dir}", ft_dir) for a in extra]
    plain_extra = ["--offload-optimizer"] if "--offload-optimizer" in extra else []
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        ft = pool.submit(run_ftbridge, ft_dir, 2, 1, [*args, *extra, "--save-params",
                         os.path.join(ft_dir, "params_{replica_group}.safetensors")], timeout_s=plan.timeout_s,
                         env={"FTBRIDGE_CROSS_REPLICA_BUCKET_BYTES": str(plan.message_bytes)})
        plain = pool.submit(run_plain, plain_dir, 1, [*args, *plain_extra, "--plain-global-of", "2", "--save-params",
                            os.path.join(plain_dir, "params.safetensors")], plan.timeout_s)
        final, _ = ft.result().finals[0], plain.result()
    g0, g1 = (_load(os.path.join(ft_dir, f"params_{g}.safetensors")) for g in (0, 1))
    diff = max_abs_diff(g0, _load(os.path.join(plain_dir, "params.safetensors")))
    replicas_equal = max_abs_diff(g0, g1) == 0.0
    row: Dict[str, Any] = {
        "part": "extras" if extra else "equivalence", "config": name, "max_abs_diff": diff,
        "replicas_equal": replicas_equal, "messages_in_backward": final.get("cross_replica_messages_in_backward"),
        "backend": final.get("cross_replica_backend"), "ok": replicas_equal and (diff <= TOLERANCE[dtype] or not exact)}
    if "--checkpoint-dir" in extra:
        row["checkpoints_verified"] = _verified_checkpoints(extra[extra.index("--checkpoint-dir") + 1])
        row["ok"] = row["ok"] and row["checkpoints_verified"] > 0
    return row


DETAIL_CHARS = 4000
"""How much of a failed part's message after its first line (the ranks' log tails) a FAIL row keeps: printed
under the row and kept in ``results.json``, so a failure seen once on a lent machine can be read afterwards."""

EXTRAS = {
    "z2_fp32_offload": (2, "fp32", True, ["--offload-optimizer"], True),
    "z2_fp32_async_ckpt": (2, "fp32", True, ["--checkpoint-dir", "{dir}/ckpt", "--checkpoint-every", "2",
                                             "--checkpoint-async"], True),
    "z2_fp32_hook_bf16": (2, "fp32", True, ["--comm-hook", "bf16"], False),
    "z3_fp32_hook_power_sgd": (3, "fp32", True, ["--comm-hook", "power_sgd", "--comm-state-option",
                                                 '{"matrix_approximation_rank": 2, "start_powerSGD_iter": 2}'],
                               False),
}
"""The extras part: ``name: (stage, dtype, overlap_comm, flags, exact)``. Optimizer offload and an async
checkpoint must still match plain DeepSpeed; a compressed all-reduce (bf16, PowerSGD) must keep the groups
identical, its difference to the baseline is the compression's."""


def _verified_checkpoints(ckpt_dir: str) -> int:
    """How many checkpoints under ``ckpt_dir`` ``ftbridge-ckpt verify`` passes (0 when any fails)."""
    import contextlib
    import io

    from ftbridge.checkpoint.cli import main as ckpt_main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = ckpt_main(["verify", ckpt_dir])
    return 0 if code else out.getvalue().count(": OK")


def d2h2d_seconds(nbytes: int, device: str) -> float:
    """Seconds of a plain device -> pinned host -> device copy of ``nbytes`` (CPU: two host copies)."""
    import torch

    src = torch.ones(max(nbytes // 4, 1), dtype=torch.float32, device=device)
    host = torch.empty(src.shape, dtype=src.dtype, pin_memory=device != "cpu")
    back = torch.empty_like(src)
    for warm in (True, False):
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        host.copy_(src, non_blocking=device != "cpu")
        back.copy_(host, non_blocking=device != "cpu")
        if device != "cpu":
            torch.cuda.synchronize()
        if not warm:
            return time.perf_counter() - t0
    return 0.0


def failover_row(workdir: str, plan: Plan) -> Dict[str, Any]:
    """Kill group 1 after both committed, wait for its heal and two more steps; phases, stall and rates."""
    from ftbridge.harness.bench.failover import survivor_stall
    from ftbridge.harness.bench.heal import heal_phases
    from ftbridge.harness.local_job import LocalJob

    model = model_flags(plan.big_model) + ["--bf16"] if plan.failover_big else model_flags(plan.model)
    args = ["--device", plan.device, "--zero-stage", "2", "--val-every", "0", "--val-batches", "1",
            *model, "--steps", "1000000", "--stop-file", os.path.join(workdir, "stop")]
    job = LocalJob(workdir, 2, 1, args, max_restarts=1, env={"OMP_NUM_THREADS": "1"}, checksum_every=None)
    t_out = plan.timeout_s
    with job:
        from ftbridge.harness.bench import failure_jobs

        job.start()
        kill_time = failure_jobs.kill_group_1_and_heal(job, 3, t_out)
        codes = job.wait(t_out)
        phases = heal_phases(job.events(1, 0), kill_time)
        stall = survivor_stall(job.steps(0), kill_time)
    copy_s = d2h2d_seconds(phases["bytes"], plan.device)
    row = {"part": "failover", "config": "z2 kill group 1" + (" big" if plan.failover_big else ""),
           "heal_total_s": phases["total_s"],
           "heal_bytes": phases["bytes"], "transfer_s": phases["transfer_s"],
           "transfer_GBps": phases["bytes"] / max(phases["transfer_s"], 1e-9) / 1e9,
           "d2h2d_GBps": phases["bytes"] / max(copy_s, 1e-9) / 1e9, "exit_codes": codes,
           **{f"phase {k} s": v for k, v in phases["phases"].items()},
           **{f"survivor {k}": v for k, v in stall.items()}}
    row["ok"] = all(c == 0 for c in codes.values())
    return row


def overhead_row(workdir: str, plan: Plan) -> Dict[str, Any]:
    """Median step time of ftbridge 2 x 1 against the plain baseline on the big model; exposed wait."""
    from ftbridge.harness.bench.jobs import run_ftbridge, run_plain, steady_median

    # bf16 gradients accumulated in bf16: per-bucket sync overlaps backward (fp32 accumulation of bf16
    # parameters, DeepSpeed's compact path, would send everything after backward).
    args = ["--device", plan.device, "--steps", str(plan.overhead_steps), "--zero-stage", "2", "--val-every", "0",
            "--val-batches", "1", "--bf16", "--grad-accum-dtype", "bf16", "--overlap-comm",
            "--reduce-bucket-size", str(25_000_000), *model_flags(plan.big_model)]
    plain = run_plain(os.path.join(workdir, "plain"), 1, [*args, "--plain-global-of", "2"], plan.timeout_s)
    ft = run_ftbridge(os.path.join(workdir, "ftbridge"), 2, 1, [*args, "--time-cross-replica-wait"],
                      timeout_s=plan.timeout_s)
    t_plain = steady_median(plain.step_times_s, plan.overhead_warmup)
    t_ft = steady_median(ft.step_times_s, plan.overhead_warmup)
    steps = max(int(ft.finals[0]["step"]), 1)
    return {"part": "overhead", "config": f"z2 bf16 {plan.big_model['n_layer']}x{plan.big_model['d_model']}",
            "plain_step_s": t_plain, "ftbridge_step_s": t_ft, "ratio": t_ft / max(t_plain, 1e-9),
            "exposed_wait_s_per_step": ft.finals[0].get("cross_replica_exposed_wait_s", 0.0) / steps,
            "cpu_wait_s_per_step": ft.cross_replica_per_step()["wait_s"], "ok": True}


def render_table(rows: Sequence[Dict[str, Any]], header: str = "") -> str:
    """The rows as a text table: one line per row, ``part | config | ok | key=value ...``."""
    lines = [header] if header else []
    for r in rows:
        rest = "  ".join(f"{k}={_fmt(v)}" for k, v in r.items() if k not in ("part", "config", "ok", "detail"))
        lines.append(f"{r['part']:<12} {r['config']:<26} {'ok' if r.get('ok') else 'FAIL':<4} {rest}")
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def run(plan: Plan, parts: Sequence[str], out: str) -> List[Dict[str, Any]]:
    """Run ``parts`` of ``plan`` under folder ``out``; a part that fails becomes a FAIL row with the error."""
    jobs: List[Any] = []
    if "equivalence" in parts:
        jobs += [(f"z{s}_{d}_{o}", lambda s=s, d=d, o=o: equivalence_row(os.path.join(out, "equivalence"), plan,
                                                                        s, d, o))
                 for s in plan.stages for d in plan.dtypes for o in plan.overlaps]
    if "extras" in parts:
        jobs += [(n, lambda n=n, c=c: equivalence_row(os.path.join(out, "extras"), plan, c[0], c[1], c[2], c[3], n,
                                                      c[4])) for n, c in EXTRAS.items()]
    if "failover" in parts:
        jobs.append(("failover", lambda: failover_row(os.path.join(out, "failover"), plan)))
    if "overhead" in parts:
        jobs.append(("overhead", lambda: overhead_row(os.path.join(out, "overhead"), plan)))
    equivalence = [j for j in jobs if j[0] not in ("failover", "overhead")]
    with concurrent.futures.ThreadPoolExecutor(max(1, plan.parallel)) as pool:  # equivalence configs at once
        rows = list(pool.map(_timed_row, equivalence))
    rows += [_timed_row(j) for j in jobs if j not in equivalence]
    return rows


def _timed_row(job: Any) -> Dict[str, Any]:
    name, fn = job
    t0 = time.time()
    try:
        row = fn()
    except Exception as e:  # noqa: BLE001 - one failed part must not hide the others' results
        part = name if name in ("failover", "overhead") else "extras" if name in EXTRAS else "equivalence"
        lines = str(e).splitlines() or [""]
        row = {"part": part, "config": name, "ok": False, "error": f"{type(e).__name__}: {lines[0][:300]}",
               "detail": "\n".join(lines[1:])[-DETAIL_CHARS:]}
    row["wall_s"] = time.time() - t0
    print(render_table([row]), flush=True)
    if row.get("detail"):
        print(row["detail"], flush=True)
    return row


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="on the CPU with gloo and small sizes")
    p.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of {PARTS}")
    p.add_argument("--stages", default="1,2,3", help="ZeRO stages of the equivalence part")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--overlap", default="off,on", help="overlap_comm settings: off, on or both")
    p.add_argument("--failover-model", choices=("small", "big"), default="small",
                   help="big: heal the overhead part's model (bf16, gigabytes of state) for a transfer rate")
    p.add_argument("--out", default=os.path.join("runs", "device_check"))
    args = p.parse_args(argv)
    parts = [x for x in args.only.split(",") if x]
    if not parts or set(parts) - set(PARTS):
        p.error(f"--only {args.only!r}: choose among {PARTS}")
    plan = make_plan(args.dry_run, tuple(int(s) for s in args.stages.split(",")))
    plan.dtypes = tuple(args.dtypes.split(","))
    plan.overlaps = tuple(o == "on" for o in args.overlap.split(","))
    plan.failover_big = args.failover_model == "big"
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            p.error("no CUDA GPU visible: run on a machine with a GPU, or pass --dry-run")
    os.environ.pop("DS_ACCELERATOR", None)  # train_lm.py --device sets it per run
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    rows = run(plan, parts, args.out)
    header = _header(args.dry_run, time.time() - t0)
    table = render_table(rows, header)
    print("\n" + table, flush=True)
    with open(os.path.join(args.out, "table.txt"), "w", encoding="utf-8") as f:
        f.write(table + "\n")
    with open(os.path.join(args.out, "results.json"), "w", encoding="utf-8") as f:
        json.dump({"header": header, "rows": rows}, f, indent=1, default=str)
    return 0 if all(r.get("ok") for r in rows) else 1


def _header(dry_run: bool, wall_s: float) -> str:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not dry_run else "CPU (dry run, gloo)"
    return (f"ftbridge device check {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  device: {gpu}  "
            f"torch {torch.__version__}  python {sys.version.split()[0]}  wall {wall_s:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
