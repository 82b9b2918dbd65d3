"""Benchmark: bytes sent, step time and loss of each communication hook against no compression.

One invocation runs the main job's model (char GPT, 4 layers, d_model 128,
827,648 parameters, context 128, micro batch 8, ZeRO-2) as 2 replica groups
x ``--nproc-per-node`` ranks for ``--steps`` steps once per hook, same data, same
seed, and prints per hook: cross-replica bytes per rank per step (steady
state, after PowerSGD's ``start_powerSGD_iter``), median step time after
warm-up, final validation loss and mean training loss of the last 10 steps,
each with its ratio to ``no``::

    python scripts/bench_comm_hooks.py                       # 100 steps, 2 groups x 1 rank
    python scripts/bench_comm_hooks.py --steps 200 --nproc-per-node 2 --rank 4 --json runs/bench/comm_hooks.json

Bytes are the payload each rank hands to the cross-replica all-reduce
(gloo moves about twice that over the wire for a ring of 2); on a 2-core
machine over loopback, step time reflects compute (compression), not a slow
link: the saving shows in bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ftbridge.harness.local_job import LocalJob

HOOKS = [("no", "no"), ("fp16", "no"), ("bf16", "no"), ("power_sgd", "no"), ("power_sgd", "fp16"),
         ("batched_power_sgd", "no")]


def run_hook(workdir: str, train_args: list, hook: str, wrapper: str, nproc: int, options: dict,
             timeout_s: float) -> dict:
    """Run the job with ``hook``; returns the final record of group 0 rank 0 and its step records."""
    result = os.path.join(workdir, "r_{replica_group}_{group_rank}.json")
    args = [*train_args, "--comm-hook", hook, "--comm-wrapper", wrapper, "--result", result]
    if hook.endswith("power_sgd"):
        args += ["--comm-state-option", json.dumps(options)]
    with LocalJob(workdir, 2, nproc, args, min_replicas=2, lighthouse_min_replicas=2) as job:
        job.start()
        codes = job.wait(timeout_s)
        if codes != {0: 0, 1: 0}:
            raise RuntimeError(f"{hook}/{wrapper} run failed {codes}\n{job.tails()}")
        finals = [e for e in job.events() if e.get("event") == "final"]
        steps = job.steps(0, 0)
    with open(result.format(replica_group=0, group_rank=0), encoding="utf-8") as f:
        times = json.load(f)["step_times_s"]
    if len({f["param_checksum"] for f in finals}) != 1:
        raise RuntimeError(f"{hook}/{wrapper}: replicas ended different: {finals}")
    return {"final": finals[0], "step_times_s": times, "losses": [s["loss"] for s in steps if s["committed"]],
            "bytes_all_ranks": sum(f["cross_replica_bytes"] for f in finals if f["replica_group"] == 0)}


def report(rows: list, args: argparse.Namespace) -> None:
    """Steady-state bytes per step, and the table with ratios against the first row (``no``)."""
    full = rows[0]["bytes_total_per_rank"] / args.steps if rows[0]["hook"] == "no" else None
    for row in rows:
        if full is not None and row["hook"].endswith("power_sgd"):
            # before start_powerSGD_iter the hook averages the whole partition (in the wrapper's dtype)
            warm = full / 2 if row["wrapper"] in ("fp16", "bf16") else full
            row["bytes_per_step"] = (row["bytes_total_per_rank"] - args.warmup * warm) / (args.steps - args.warmup)
        else:
            row["bytes_per_step"] = row["bytes_total_per_rank"] / args.steps
    base = rows[0]
    print(f"\n{args.steps} steps, 2 replica groups x {args.nproc} rank(s), ZeRO-{args.zero_stage}, "
          f"PowerSGD rank {args.rank} from step {args.warmup}; ratios against {base['hook']}")
    print(f"{'hook':<26}{'bytes/step':>12}{'x':>7}{'step ms':>9}{'x':>7}{'val loss':>10}{'x':>7}"
          f"{'train loss':>12}{'x':>7}")
    for row in rows:
        name = row["hook"] + ("" if row["wrapper"] == "no" else f"+{row['wrapper']}")
        print(f"{name:<26}{row['bytes_per_step']:>12,.0f}{row['bytes_per_step'] / base['bytes_per_step']:>7.3f}"
              f"{row['step_time_s'] * 1e3:>9.1f}{row['step_time_s'] / base['step_time_s']:>7.2f}"
              f"{row['val_loss']:>10.4f}{row['val_loss'] / base['val_loss']:>7.3f}"
              f"{row['train_loss_last10']:>12.4f}{row['train_loss_last10'] / base['train_loss_last10']:>7.3f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10,
                   help="steps left out of the timing; also PowerSGD's start_powerSGD_iter")
    p.add_argument("--nproc-per-node", "--nproc", dest="nproc", type=int, default=1,
                   help="ranks per replica group (ZeRO partitions), as ftbridge-run's flag (--nproc: the old spelling)")
    p.add_argument("--rank", type=int, default=4, help="PowerSGD matrix_approximation_rank")
    p.add_argument("--zero-stage", type=int, default=2, choices=(1, 2, 3))
    p.add_argument("--hooks", default=",".join(f"{h}+{w}" for h, w in HOOKS),
                   help="comma-separated hook+wrapper pairs")
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument("--timeout-s", type=float, default=900)
    p.add_argument("--report", default=None, metavar="JSON", help="print the table of an earlier --json run")
    args = p.parse_args(argv)
    if args.report:
        with open(args.report, encoding="utf-8") as f:
            saved = json.load(f)
        report(saved["rows"], argparse.Namespace(**saved["args"]))
        return 0
    if args.steps <= args.warmup + 10:
        p.error(f"--steps {args.steps} must exceed --warmup {args.warmup} by more than 10")
    train = ["--steps", str(args.steps), "--zero-stage", str(args.zero_stage), "--val-every", "0",
             "--val-batches", "8", "--sync-mode", "post_backward"]
    options = {"matrix_approximation_rank": args.rank, "start_powerSGD_iter": args.warmup}
    rows = []
    for pair in args.hooks.split(","):
        hook, _, wrapper = pair.partition("+")
        with tempfile.TemporaryDirectory(prefix=f"bench_{hook}_") as wd:
            r = run_hook(wd, train, hook, wrapper or "no", args.nproc, options, args.timeout_s)
        total = r["bytes_all_ranks"] / args.nproc
        rows.append({"hook": hook, "wrapper": wrapper or "no", "bytes_total_per_rank": total,
                     "step_time_s": statistics.median(r["step_times_s"][args.warmup:]),
                     "val_loss": r["final"]["val_loss"], "train_loss_last10": statistics.mean(r["losses"][-10:]),
                     "compression_rate": r["final"].get("comm_hook_compression_rate")})
        print(f"done {hook}+{wrapper or 'no'}", flush=True)
    report(rows, args)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
