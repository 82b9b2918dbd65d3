"""Benchmark ``memory``: peak RSS per rank of ftbridge against plain DeepSpeed.

The same pairs of runs as :mod:`ftbridge.harness.bench.overhead` (ftbridge ``GROUPS``
x ``RANKS`` against plain DeepSpeed on ``GROUPS * RANKS`` ranks, same model,
data, steps and ZeRO stage); when both benchmarks run in one invocation the
runs are made once (:mod:`ftbridge.harness.bench.jobs` memoizes them). Every
rank records its peak resident set size (``getrusage`` ``ru_maxrss``) as
``peak_rss_bytes`` in its ``--result`` record; a run's sample is the largest
over its ranks, in MiB. The figure is the per-repetition ratio, ftbridge /
plain, median over repetitions. Target ``<= 1.10``.

What ftbridge adds per rank: torchft's manager and its process groups, the
cross-replica gloo buffers, the event log, and a heal's state copy (none in
a run without failures). The lighthouse runs in the benchmark process, not in
a rank, and the torchrun launchers are outside both figures.
"""

from __future__ import annotations

import logging
import os
from typing import List

from ftbridge.harness.bench import jobs
from ftbridge.harness.bench.core import BenchSettings, Metric, benchmark, paired_bars, ratio_metric, save_figure
from ftbridge.harness.bench.overhead import GROUPS, RANKS

TARGET_MAX = 1.10
MIB = 1 << 20

log = logging.getLogger("ftbridge.harness.bench")


def plot(metrics: List[Metric], path: str) -> None:
    """Bars of peak RSS per rank (MiB), plain DeepSpeed and ftbridge, per ZeRO stage."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    paired_bars(ax, metrics, color="tab:orange")
    ax.set_ylabel("peak RSS per rank (MiB)")
    ax.set_ylim(0, max(max(m.extra["candidate_samples"]) for m in metrics) * 1.15)
    ax.set_title("Peak RSS per rank (target ftbridge / plain <= 1.10)")
    ax.legend(fontsize=8, loc="lower right")
    save_figure(fig, path)


@benchmark("memory", plot=plot)
def run(settings: BenchSettings) -> List[Metric]:
    """One ratio metric per ZeRO stage: ftbridge peak RSS per rank / plain DeepSpeed's (largest rank of each).

    Raises:
        RuntimeError, TimeoutError: a training run failed or ran past ``settings.timeout_s``.
        KeyError: a result record has no ``peak_rss_bytes`` (the training script is too old).
    """
    model = jobs.QUICK_MODEL if settings.quick else jobs.MAIN_MODEL
    stages = (2,) if settings.quick else (1, 2, 3)
    steps = settings.warmup_steps + settings.steps
    root = os.path.join(settings.workdir, "memory")
    metrics = []
    for stage in stages:
        args = jobs.train_args(steps=steps, zero_stage=stage, model=model)

        def plain(rep: int) -> float:
            res = jobs.run_plain(jobs.next_run_dir(root, f"plain_z{stage}"), GROUPS * RANKS, args, settings.timeout_s,
                                 rep=rep)
            return max(res.peak_rss_bytes) / MIB

        def ftbridge(rep: int) -> float:
            res = jobs.run_ftbridge(jobs.next_run_dir(root, f"ftbridge_z{stage}"), GROUPS, RANKS, args,
                                    timeout_s=settings.timeout_s, rep=rep)
            return max(res.peak_rss_bytes) / MIB

        log.info("memory: ZeRO-%d peak RSS, ftbridge %dx%d vs plain DeepSpeed %d ranks, %d rep(s)", stage, GROUPS,
                 RANKS, GROUPS * RANKS, settings.reps)
        cand, base = jobs.alternate(settings.reps, ftbridge, plain, log.info)
        metrics.append(ratio_metric(
            "memory", f"peak RSS per rank ZeRO-{stage}, ftbridge {GROUPS}x{RANKS} / plain DS {GROUPS * RANKS} ranks",
            cand, base, baseline_name=f"plain DeepSpeed {GROUPS * RANKS} ranks, peak RSS of the largest rank",
            target_max=TARGET_MAX,
            extra={"zero_stage": stage, "baseline_unit": "MiB", "steps": steps, "model": model}))
    return metrics
