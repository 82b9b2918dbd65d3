"""Benchmark ``scaling``: how the per-step cross-replica cost grows with groups and model size.

**Cross-replica cost** of a configuration (G replica groups x 1 rank, one
model) is the median step time of the ftbridge job minus the median step
time of the same job with ``--no-cross-replica-sync`` (quorum, commit vote
and everything else unchanged; only the cross-replica all-reduce of the
gradient partition is skipped), paired repetitions alternating the order,
warm-up steps dropped. It is the time the all-reduce adds to a step, after
whatever overlap the default sync mode achieves. Each metric also records
the bytes handed to the cross-replica all-reduce per step, its calls per
step and its **exposed wait** (the time ``step()`` blocked on an all-reduce
not finished by the end of backward, ``cross_replica_wait_s`` of the rank's
``final`` event: a direct and far less noisy figure than the difference of
two step times, though it leaves out the cost of issuing the all-reduces and
the CPU their threads take from backward), and the step time itself.

Two sweeps, sharing their common point:

* groups: G = 1..4 (``--quick``: 1..2) with the base model (the main job's;
  ``--quick``: a 0.1 M-parameter one);
* model size: three sizes via ``--n-layer``/``--d-model`` (``--quick``: two
  small ones) at G = 2.

Informative only, no target. On a 2-core machine G = 3 and 4 put more ranks
than cores: those points include CPU oversubscription (``oversubscribed``
in the metric's extra), and so does the step time they are subtracted from.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, List, Sequence, Tuple

from ftbridge.harness.bench.core import BenchSettings, Metric, benchmark, median, save_figure
from ftbridge.harness.bench.jobs import (
    MAIN_MODEL,
    QUICK_MODEL,
    alternate,
    model_params,
    next_run_dir,
    run_ftbridge,
    steady_median,
    train_args,
)

SIZES_GROUPS = 2
"""Replica groups of the model-size sweep."""

log = logging.getLogger("ftbridge.harness.bench")


def sweeps(quick: bool) -> Tuple[Sequence[int], Dict[str, int], List[Dict[str, int]]]:
    """``(group counts, model of the groups sweep, models of the size sweep)``."""
    if quick:
        return (1, 2), QUICK_MODEL, [QUICK_MODEL, {**QUICK_MODEL, "n_layer": 3, "d_model": 96}]
    return (1, 2, 3, 4), MAIN_MODEL, [{**MAIN_MODEL, "n_layer": 2, "d_model": 64}, MAIN_MODEL,
                                      {**MAIN_MODEL, "n_layer": 6, "d_model": 192}]


def plot(metrics: List[Metric], path: str) -> None:
    """Two panels: cross-replica cost (ms, whiskers min..max) against groups and against parameters."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, axis, xkey, xlabel in ((axes[0], "groups", "groups", "replica groups (1 rank each)"),
                                   (axes[1], "params", "params", "model parameters")):
        ms = sorted((m for m in metrics if m.extra["axis"] == axis and m.extra.get("kind") != "exposed"),
                    key=lambda m: m.extra[xkey])
        xs = [m.extra[xkey] for m in ms]
        ys = [m.value for m in ms]
        err = [[m.value - min(m.samples) for m in ms], [max(m.samples) - m.value for m in ms]]
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label="cost: step time with sync - without")
        if all("exposed_wait_ms" in m.extra for m in ms):
            ax.plot(xs, [m.extra["exposed_wait_ms"] for m in ms], marker="s", ls="--", color="tab:orange",
                    label="exposed wait: step() blocked on the all-reduce")
        ax.legend(fontsize=7)
        for m in ms:
            ax.annotate(f"{m.extra['bytes_per_step'] / 1e6:.2f} MB/step", (m.extra[xkey], m.value), fontsize=7,
                        textcoords="offset points", xytext=(4, 6))
            if m.extra.get("oversubscribed"):
                ax.axvspan(m.extra[xkey] - 0.3, m.extra[xkey] + 0.3, color="tab:red", alpha=0.08)
        ax.axhline(0, color="gray", lw=0.5)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("ms per step")
        if axis == "groups":
            ax.set_xticks(xs)
            ax.set_title("vs replica groups" + (" (red: more ranks than cores)" if any(
                m.extra.get("oversubscribed") for m in ms) else ""), fontsize=10)
        else:
            ax.set_xscale("log")
            ax.minorticks_off()
            ax.set_xticks(xs, [f"{x / 1e6:.2f} M" for x in xs])
            ax.set_title(f"vs model size ({SIZES_GROUPS} groups)", fontsize=10)
    fig.suptitle("Per-step cross-replica cost", fontsize=11)
    save_figure(fig, path)


@benchmark("scaling", plot=plot)
def run(settings: BenchSettings) -> List[Metric]:
    """Two metrics (ms, no target) per point of each sweep: the cost, then (after all costs) the exposed wait.

    Raises:
        RuntimeError, TimeoutError: a training run failed or ran past ``settings.timeout_s``.
    """
    group_counts, base, models = sweeps(settings.quick)
    root = os.path.join(settings.workdir, "scaling")
    cache: Dict[Tuple[int, Tuple[Tuple[str, int], ...]], Dict[str, Any]] = {}

    def point(groups: int, model: Dict[str, int]) -> Dict[str, Any]:
        key = (groups, tuple(sorted(model.items())))
        if key not in cache:
            cache[key] = measure(settings, root, groups, model)
        return cache[key]

    metrics = []
    for g in group_counts:
        metrics.append(cost_metric(point(g, base), "groups", f"cross-replica cost vs groups: {g} group(s) x 1 rank"))
    for model in models:
        p = point(SIZES_GROUPS, model)
        metrics.append(cost_metric(p, "params", f"cross-replica cost vs model size: {p['params'] / 1e6:.2f} M "
                                                f"params, {SIZES_GROUPS} groups"))
    return metrics + [exposed_metric(m) for m in metrics]


def measure(settings: BenchSettings, root: str, groups: int, model: Dict[str, int]) -> Dict[str, Any]:
    """Paired runs with and without the cross-replica all-reduce; costs and step times in seconds."""
    args = train_args(steps=settings.steps + settings.warmup_steps, zero_stage=2, model=model)
    params = model_params(model)
    per_step: List[Dict[str, float]] = []
    tag = f"g{groups}_l{model['n_layer']}_d{model['d_model']}"

    def with_sync(rep: int) -> float:
        # Not memoized (no rep=): a run timed minutes earlier by another benchmark would not pair in time.
        res = run_ftbridge(next_run_dir(root, f"sync_{tag}"), groups, 1, args, timeout_s=settings.timeout_s)
        per_step.append(res.cross_replica_per_step())
        return steady_median(res.step_times_s, settings.warmup_steps)

    def without(rep: int) -> float:
        res = run_ftbridge(next_run_dir(root, f"nosync_{tag}"), groups, 1, [*args, "--no-cross-replica-sync"],
                           timeout_s=settings.timeout_s)
        return steady_median(res.step_times_s, settings.warmup_steps)

    log.info("scaling: %d group(s) x 1 rank, %d params, with vs without cross-replica sync, %d rep(s)", groups,
             params, settings.reps)
    sync_s, nosync_s = alternate(settings.reps, with_sync, without, log.info)
    return {"groups": groups, "params": params, "model": model, "sync_s": sync_s, "nosync_s": nosync_s,
            "bytes_per_step": median([p["bytes"] for p in per_step]),
            "allreduces_per_step": median([p["allreduces"] for p in per_step]),
            "wait_ms": [p["wait_s"] * 1e3 for p in per_step],
            "oversubscribed": groups > (os.cpu_count() or 1)}


def exposed_metric(cost: Metric) -> Metric:
    """The exposed-wait twin of a :func:`cost_metric`: ms per step ``step()`` blocked on the all-reduce."""
    samples = cost.extra["exposed_wait_samples_ms"]
    return Metric("scaling", cost.name.replace("cross-replica cost", "exposed wait"), median(samples), "ms", samples,
                  extra={"axis": cost.extra["axis"], "kind": "exposed", "groups": cost.extra["groups"],
                         "params": cost.extra["params"], "oversubscribed": cost.extra["oversubscribed"]})


def cost_metric(p: Dict[str, Any], axis: str, name: str) -> Metric:
    """A ``ms`` metric from :func:`measure`'s point: median of per-repetition (sync - no sync) step times."""
    sync_s, nosync_s = p["sync_s"], p["nosync_s"]
    costs = [(a - b) * 1e3 for a, b in zip(sync_s, nosync_s)]
    return Metric("scaling", name, median(costs), "ms", costs, baseline=median(nosync_s) * 1e3,
                  baseline_name="same job with --no-cross-replica-sync, median step",
                  extra={"axis": axis, "groups": p["groups"], "params": p["params"], "model": p["model"],
                         "bytes_per_step": p["bytes_per_step"], "allreduces_per_step": p["allreduces_per_step"],
                         "exposed_wait_ms": median(p["wait_ms"]), "exposed_wait_samples_ms": p["wait_ms"],
                         "step_time_ms": median(sync_s) * 1e3, "sync_samples_s": sync_s, "nosync_samples_s": nosync_s,
                         "oversubscribed": p["oversubscribed"], "baseline_unit": "ms"})
