"""Benchmark ``overlap``: per-bucket cross-replica all-reduce against one post-backward all-reduce.

ftbridge runs of the same job (``GROUPS`` replica groups x 1 rank,
ZeRO-2), repetitions rotating their order:

* candidates: ``FTBRIDGE_SYNC_MODE=per_bucket``, the reduced DeepSpeed buckets
  all-reduced across replicas while backward computes the next buckets
  (:mod:`ftbridge.zero.grad_sync`), at three message sizes
  (:data:`VARIANTS`; ``--quick``: the first only):
  messages of at least half a DeepSpeed bucket (about one or two per bucket;
  ``FTBRIDGE_CROSS_REPLICA_BUCKET_BYTES=0`` would send one per parameter, whose
  per-call cost on 2 cores swamps the step), buckets coalesced into about 3
  messages, and the library default;
* baseline: ``FTBRIDGE_SYNC_MODE=post_backward``: one all-reduce of the whole
  partition once backward has ended (``sync_mode=post_backward``).

A small ``--reduce-bucket-size`` gives the model at least ``MIN_BUCKETS``
buckets. The bucket count is checked, not assumed: the finest per-bucket run's
cross-replica all-reduce calls per step (from its ``final`` event) must be at
least ``MIN_BUCKETS``, or the benchmark fails. The figures are the ratios of
median step times, per-bucket / post-backward, one per variant. Target ``<= 1.0`` (never
slower); the aspiration is 1.2x faster (ratio ``<= 0.83``), which on 2 CPU
cores is out of reach: gloo's sends and the backward compete for the same
two cores, so there is little idle time to overlap into.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any, Callable, List, Optional, Tuple

from ftbridge.harness.bench.core import BenchSettings, Metric, benchmark, ratio_metric, save_figure
from ftbridge.harness.bench.jobs import (
    MAIN_MODEL,
    QUICK_MODEL,
    model_params,
    next_run_dir,
    rotate,
    run_ftbridge,
    steady_median,
    train_args,
)

GROUPS = 2
MIN_BUCKETS = 8
ASPIRATION = "aim: 1.2x faster (ratio <= 0.83)"

log = logging.getLogger("ftbridge.harness.bench")


VARIANTS = (("finest", None), ("coalesced", None), ("default", ""))
"""Per-bucket variants (name, ``FTBRIDGE_CROSS_REPLICA_BUCKET_BYTES``; ``None``: computed per model):
messages of at least half a DeepSpeed bucket; buckets coalesced into about ``COALESCED_MESSAGES``
messages; the library default (25 MiB: one message on these models). Quick runs only the first."""

COALESCED_MESSAGES = 3


def plot(metrics: List[Metric], path: str) -> None:
    """Median step time (ms) of post-backward and each per-bucket variant, whiskers min..max, one panel."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2 + 1.6 * (len(metrics) + 1), 3.5))
    bars: List[Tuple[str, Any, str, Optional[float]]] = [
        ("post-backward\n(1 all-reduce/step)", metrics[0].extra["baseline_samples"], "tab:gray", None)]
    bars += [(f"per-bucket, {m.extra['variant']}\n({m.extra['messages_per_step']:.0f} all-reduces/step)",
              m.extra["candidate_samples"], "tab:blue", m.value) for m in metrics]
    for i, (_label, samples, color, ratio) in enumerate(bars):
        ms = sorted(v * 1e3 for v in samples)
        mid = ms[len(ms) // 2]
        ax.bar(i, mid, 0.5, color=color, yerr=[[mid - ms[0]], [ms[-1] - mid]], capsize=4)
        ax.text(i, mid / 2, f"{mid:.1f} ms" + ("" if ratio is None else f"\n{ratio:.3f}x"), ha="center",
                color="white", fontsize=9)
    ax.set_xticks(range(len(bars)), [b[0] for b in bars], fontsize=8)
    ax.set_ylabel("median step time (ms)")
    ax.set_title(f"Overlap, ZeRO-2, {metrics[0].extra['buckets']} DeepSpeed buckets (target: ratio <= 1.0)",
                 fontsize=10)
    save_figure(fig, path)


@benchmark("overlap", plot=plot)
def run(settings: BenchSettings) -> List[Metric]:
    """One ratio metric per per-bucket variant (:data:`VARIANTS`): its median step time / post-backward's.

    Raises:
        RuntimeError: a run failed, or the finest per-bucket run issued fewer than
            ``MIN_BUCKETS`` cross-replica all-reduces per step (the model has too few buckets).
        TimeoutError: a run went past ``settings.timeout_s``.
    """
    model = QUICK_MODEL if settings.quick else MAIN_MODEL
    params = model_params(model)
    # Elements, a few buckets over MIN_BUCKETS; a multiple of 1024 (DeepSpeed wants it aligned).
    bucket = max(1024, params // (MIN_BUCKETS + 2) // 1024 * 1024)
    buckets = math.ceil(params / bucket)
    args = train_args(steps=settings.steps + settings.warmup_steps, zero_stage=2, model=model,
                      reduce_bucket_size=bucket)
    root = os.path.join(settings.workdir, "overlap")
    # fp32 bytes of ceil(buckets / COALESCED_MESSAGES) DeepSpeed buckets per message.
    sizes = {"finest": str(bucket * 4 // 2),
             "coalesced": str(math.ceil(buckets / COALESCED_MESSAGES) * bucket * 4)}
    variants = [(v, sizes[v] if b is None else b) for v, b in (VARIANTS[:1] if settings.quick else VARIANTS)]
    messages: dict = {}

    def sync(mode: str, variant: str, bucket_bytes: str, rep: int) -> float:
        env = {"FTBRIDGE_SYNC_MODE": mode}
        if bucket_bytes:
            env["FTBRIDGE_CROSS_REPLICA_BUCKET_BYTES"] = bucket_bytes
        res = run_ftbridge(next_run_dir(root, f"{mode}_{variant}"), GROUPS, 1, args, timeout_s=settings.timeout_s,
                           env=env, rep=rep)
        messages.setdefault(variant, []).append(res.cross_replica_per_step()["allreduces"])
        return steady_median(res.step_times_s, settings.warmup_steps)

    log.info("overlap: ZeRO-2, %d params, %d buckets of %d elements, post-backward vs per-bucket %s, %d rep(s)",
             params, buckets, bucket, ", ".join(v for v, _ in variants), settings.reps)
    fns: List[Callable[[int], float]] = [lambda rep: sync("post_backward", "post", "", rep)]

    def per_bucket(v: str, b: str) -> Callable[[int], float]:
        return lambda rep: sync("per_bucket", v, b, rep)

    fns += [per_bucket(v, b) for v, b in variants]
    base, *cands = rotate(settings.reps, fns)
    finest = min(messages["finest"])
    if finest < MIN_BUCKETS:
        raise RuntimeError(f"the per-bucket run issued {finest:g} cross-replica all-reduces per step, fewer than "
                           f"{MIN_BUCKETS}: lower --reduce-bucket-size (now {bucket} elements for {params} params)")
    metrics = []
    for (variant, bucket_bytes), cand in zip(variants, cands):
        per_step = min(messages[variant])
        what = {"finest": f"messages of >= 1/2 bucket, {per_step:g}",
                "coalesced": f"buckets coalesced to {per_step:g} messages",
                "default": f"default coalescing, {per_step:g} message(s)"}[variant]
        log.info("  per-bucket %s: %s", variant, [round(c / b, 3) for c, b in zip(cand, base)])
        metrics.append(ratio_metric(
            "overlap", f"step time ZeRO-2, per-bucket ({what}) / post-backward, {buckets} buckets",
            cand, base, baseline_name="ftbridge post-backward all-reduce, median step", target_max=1.0,
            extra={"note": ASPIRATION, "variant": variant, "buckets": buckets, "messages_per_step": per_step,
                   "cross_replica_bucket_bytes": bucket_bytes or "default",
                   "reduce_bucket_size": bucket, "params": params, "groups": GROUPS, "baseline_unit": "s",
                   "model": model}))
    return metrics
