"""Checkpoint cost on the main job's model: training stall per save, and resume at another size.

1. Training stall per checkpoint (2 ranks, ZeRO-2): DeepSpeed's plain
   ``save_checkpoint``, ftbridge's sync save and its async save, plus the
   step right after each (worker ``stall`` of :mod:`ftbridge.harness.bench.rescale_worker`).
2. Resume at a different number of ranks: the suite's ``rescale`` benchmark
   (:mod:`ftbridge.harness.bench.rescale`; also run by ``ftbridge-bench``).

Run::

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_checkpoint.py [--saves 8] [--reps 2] [--out runs/bench_checkpoint]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from ftbridge.harness.bench import failure_jobs, rescale  # noqa: E402
from ftbridge.harness.bench.core import BenchSettings  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(REPO, "runs", "bench_checkpoint"))
    p.add_argument("--saves", type=int, default=8, help="checkpoints per mode for the stall medians")
    p.add_argument("--reps", type=int, default=2, help="repetitions of the resume measurement")
    args = p.parse_args()
    out = os.path.abspath(args.out)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    print(f"1/2 stall per checkpoint, 2 ranks, {args.saves} saves per mode ...", flush=True)
    failure_jobs.torchrun(2, rescale.WORKER, ["--worker", "stall", "--out", out, "--saves", str(args.saves)], 900)
    with open(os.path.join(out, "stall.json"), encoding="utf-8") as f:
        stall = json.load(f)
    ds = stall["deepspeed"]
    print(f"\nmedian training step {stall['step_s'] * 1e3:.1f} ms (2 ranks, ZeRO-2, 827,648 parameters)")
    print(f"{'save':<16}{'stall ms':>10}{'vs DeepSpeed':>14}{'next step ms':>14}")
    for name in ("deepspeed", "ftbridge_sync", "ftbridge_async"):
        r = stall[name]
        print(f"{name:<16}{r['stall_s'] * 1e3:>10.1f}{r['stall_s'] / ds['stall_s']:>13.2f}x"
              f"{r['next_step_s'] * 1e3:>14.1f}")
    print("\n2/2 resume a 4-rank job on 2 ranks (ftbridge.harness.bench.rescale) ...", flush=True)
    metrics = rescale.run(BenchSettings(workdir=out, reps=args.reps, timeout_s=900))
    for m in metrics:
        print(f"  {m.name}: {m.value:.3f} {m.unit}" + (f" (target {m.target}: {'met' if m.met else 'NOT met'})"
                                                     if m.target else ""))
    with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as f:
        json.dump({"stall": stall, "rescale": [m.to_json() for m in metrics]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
