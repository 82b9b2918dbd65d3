"""Benchmark: ftbridge step time against plain DeepSpeed, and per-bucket against post-backward sync.

Runs, in one invocation and alternating the order, R repetitions of:

* ``plain``: plain DeepSpeed data parallel, 2 ranks (one torchrun world);
* ``ftbridge per_bucket`` and ``ftbridge post_backward``: 2 replica groups x 1
  rank through ftbridge (lighthouse, quorum, cross-replica all-reduce);

all with the main job's model (char GPT, 4 layers, d_model 128, context 128,
micro batch 8), ZeRO-2, the same data. Small DeepSpeed buckets
(``--reduce-bucket-size``, default 100k elements: 8+ buckets for this model)
so the per-bucket hook has buckets to overlap. Reports the median step time
after warm-up, its spread over repetitions, and the ratios::

    python scripts/bench_step_time.py                 # 3 repetitions x 60 steps
    python scripts/bench_step_time.py --reps 5 --steps 100 --json runs/bench/step_time.json

Targets (issue #2): ftbridge / plain <= 1.05; per-bucket / post-backward <= 1.0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ftbridge.local_job import LocalJob, run_plain_deepspeed  # noqa: E402


def run_plain(workdir: str, train_args: list, timeout_s: float) -> list:
    result = os.path.join(workdir, "plain_{dp_rank}.json")
    run_plain_deepspeed(workdir, 2, [*train_args, "--result", result], timeout_s)
    with open(result.format(dp_rank=0), encoding="utf-8") as f:
        return json.load(f)["step_times_s"]


def run_ftbridge(workdir: str, train_args: list, mode: str, timeout_s: float, bucket_bytes=None) -> list:
    result = os.path.join(workdir, "ft_{replica_group}.json")
    env = {"FTBRIDGE_SYNC_MODE": mode}
    if bucket_bytes is not None:
        env["FTBRIDGE_CROSS_REPLICA_BUCKET_BYTES"] = str(bucket_bytes)
    with LocalJob(workdir, 2, 1, [*train_args, "--result", result], min_replicas=2, lighthouse_min_replicas=2,
                  env=env) as job:
        job.start()
        codes = job.wait(timeout_s)
        if codes != {0: 0, 1: 0}:
            raise RuntimeError(f"ftbridge run failed {codes}\n{job.tails()}")
    with open(result.format(replica_group=0), encoding="utf-8") as f:
        return json.load(f)["step_times_s"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the timing")
    p.add_argument("--reduce-bucket-size", type=int, default=100_000)
    p.add_argument("--zero-stage", type=int, default=2, choices=(1, 2, 3))
    p.add_argument("--cross-replica-bucket-bytes", type=int, default=None,
                   help="ftbridge's cross-replica message size (default: ftbridge's default, 25 MiB)")
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument("--timeout-s", type=float, default=600)
    args = p.parse_args(argv)
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    train = ["--steps", str(args.steps), "--zero-stage", str(args.zero_stage), "--val-every", "0",
             "--val-batches", "1", "--reduce-bucket-size", str(args.reduce_bucket_size)]
    medians = {"plain": [], "per_bucket": [], "post_backward": []}
    for rep in range(args.reps):
        order = ["plain", "per_bucket", "post_backward"]
        order = order[rep % 3:] + order[:rep % 3]
        for name in order:
            with tempfile.TemporaryDirectory(prefix=f"bench_{name}_") as wd:
                times = run_plain(wd, train, args.timeout_s) if name == "plain" else \
                    run_ftbridge(wd, train, name, args.timeout_s, args.cross_replica_bucket_bytes)
            med = statistics.median(times[args.warmup:])
            medians[name].append(med)
            print(f"rep {rep} {name:>13}: median step {med * 1e3:7.1f} ms", flush=True)
    fig = {k: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v)} for k, v in medians.items()}
    ratios = {
        "ftbridge_per_bucket / plain": fig["per_bucket"]["median_s"] / fig["plain"]["median_s"],
        "ftbridge_post_backward / plain": fig["post_backward"]["median_s"] / fig["plain"]["median_s"],
        "per_bucket / post_backward": fig["per_bucket"]["median_s"] / fig["post_backward"]["median_s"],
    }
    targets = {"ftbridge_per_bucket / plain": 1.05, "ftbridge_post_backward / plain": 1.05,
               "per_bucket / post_backward": 1.0}
    print(f"\n{'run':>15} {'median ms':>10} {'min ms':>8} {'max ms':>8}   ({args.reps} reps x "
          f"{args.steps - args.warmup} timed steps, ZeRO-{args.zero_stage})")
    for k, v in fig.items():
        print(f"{k:>15} {v['median_s'] * 1e3:>10.1f} {v['min_s'] * 1e3:>8.1f} {v['max_s'] * 1e3:>8.1f}")
    for k, v in ratios.items():
        verdict = "met" if v <= targets[k] else "NOT met"
        print(f"{k:>32}: {v:.3f} (target <= {targets[k]}: {verdict})")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"figures": fig, "ratios": ratios, "targets": targets, "args": vars(args)}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
