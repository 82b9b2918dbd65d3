"""Benchmark ``overhead``: ftbridge's steady-state step time against plain DeepSpeed.

For each ZeRO stage (1, 2, 3; ``--quick``: 2 only), repetitions alternate
the order of two runs of the main job, same model, data, ZeRO stage and
bucket size:

* candidate: ftbridge, ``GROUPS`` replica groups x ``RANKS`` rank (lighthouse,
  quorum every step, cross-replica all-reduce through torchft);
* baseline: plain DeepSpeed data parallel on ``GROUPS * RANKS`` ranks (one
  torchrun world, ``--plain``).

Both see the same global batch per step. The figure is the per-repetition
ratio of median step times (warm-up steps dropped), median over
repetitions. Target ``<= 1.03``.

The divergence guard (:mod:`ftbridge.guard`) runs every
``guard_every`` = 100 committed steps by default, so a run of this length
would check at most once; its cost is measured apart, ZeRO-2: an ftbridge run
with ``FTBRIDGE_GUARD_EVERY=1`` reports the seconds its checks took
(``guard_s`` / ``guard_checks`` of every rank's ``final`` event, the slowest
rank); the metric is that per-check time divided by ``guard_every`` (the
default), as a fraction of the same run's median step time. Target ``<= 0.005``.

Full runs also attribute the cost, ZeRO-2: ftbridge on one group of
``GROUPS * RANKS`` ranks (the machinery without a cross-replica partner), and
ftbridge with each robustness feature of :data:`FEATURES_OFF` turned off
against ftbridge with every feature on (fresh pairs).

On the 2-core CI machine the topology is 2 groups x 1 rank against 2 plain
ranks: more ranks than cores would measure CPU oversubscription, not
ftbridge. Note that the two are not the same communication pattern: plain
DeepSpeed reduces inside one 2-rank world, ftbridge reduces inside 1-rank
groups (nothing to do) and then across the groups.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Dict, List

from ftbridge.harness.bench.core import BenchSettings, Metric, benchmark, paired_bars, ratio_metric, save_figure
from ftbridge.harness.bench.jobs import (
    MAIN_MODEL,
    QUICK_MODEL,
    alternate,
    next_run_dir,
    run_ftbridge,
    run_plain,
    steady_median,
    train_args,
)

GROUPS, RANKS = 2, 1
"""ftbridge topology (replica groups x ranks per group); the baseline has ``GROUPS * RANKS`` ranks."""

TARGET_MAX = 1.03
GUARD_TARGET_MAX = 0.005
"""The divergence guard at its default interval: at most 0.5 % of a step."""

log = logging.getLogger("ftbridge.harness.bench")


def plot(metrics: List[Metric], path: str) -> None:
    """Bars of plain DeepSpeed and ftbridge median step time (ms) per ZeRO stage, whiskers min..max."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    # Fractions of a step and ftbridge-against-ftbridge ratios: in the table only.
    metrics = [m for m in metrics if not any(m.extra.get(k) for k in ("guard", "protocol", "features_off"))]
    paired_bars(ax, metrics, scale=1e3, color="tab:blue")
    ax.set_ylabel("median step time (ms)")
    ax.set_title(f"Steady-state overhead: ftbridge {GROUPS}x{RANKS} vs plain DeepSpeed {GROUPS * RANKS} ranks")
    ax.legend(fontsize=8)
    save_figure(fig, path)


@benchmark("overhead", plot=plot)
def run(settings: BenchSettings) -> List[Metric]:
    """One ratio metric per ZeRO stage: ftbridge median step time / plain DeepSpeed's.

    Raises:
        RuntimeError, TimeoutError: a training run failed or ran past ``settings.timeout_s``.
    """
    model = QUICK_MODEL if settings.quick else MAIN_MODEL
    stages = (2,) if settings.quick else (1, 2, 3)
    root = os.path.join(settings.workdir, "overhead")
    metrics = []
    for stage in stages:
        args = train_args(steps=settings.steps + settings.warmup_steps, zero_stage=stage, model=model)

        def plain(rep: int) -> float:
            res = run_plain(next_run_dir(root, f"plain_z{stage}"), GROUPS * RANKS, args, settings.timeout_s,
                            rep=rep)
            return steady_median(res.step_times_s, settings.warmup_steps)

        protocol: List[float] = []  # seconds per step in the commit protocol (agreement + in-group exchange)
        protocol_base: List[float] = []

        def ftbridge(rep: int) -> float:
            res = run_ftbridge(next_run_dir(root, f"ftbridge_z{stage}"), GROUPS, RANKS, args,
                               timeout_s=settings.timeout_s, rep=rep)
            step = steady_median(res.step_times_s, settings.warmup_steps)
            per_step = [f["protocol_s"] / max(f["protocol_steps"], 1) for f in res.finals if "protocol_s" in f]
            if per_step:
                protocol.append(max(per_step))
                protocol_base.append(step)
            return step

        log.info("overhead: ZeRO-%d, ftbridge %dx%d vs plain DeepSpeed %d ranks, %d rep(s)", stage, GROUPS, RANKS,
                 GROUPS * RANKS, settings.reps)
        cand, base = alternate(settings.reps, ftbridge, plain, log.info)
        metrics.append(ratio_metric(
            "overhead", f"step time ZeRO-{stage}, ftbridge {GROUPS}x{RANKS} / plain DS {GROUPS * RANKS} ranks",
            cand, base, baseline_name=f"plain DeepSpeed {GROUPS * RANKS} ranks, median step", target_max=TARGET_MAX,
            extra={"zero_stage": stage, "groups": GROUPS, "ranks_per_group": RANKS, "baseline_unit": "s",
                   "model": model, "timed_steps": settings.steps}))
        if stage == 2 and protocol:
            metrics.append(ratio_metric(
                "overhead", f"commit protocol per step (agreement + in-group exchange), ZeRO-2 {GROUPS}x{RANKS} / "
                "step time", protocol, protocol_base, baseline_name="ftbridge median step",
                extra={"zero_stage": 2, "baseline_unit": "s", "model": model, "protocol": True}))
        if stage == 2 and not settings.quick:
            metrics.append(_one_group(settings, root, args, plain, model))
            metrics.extend(_features_off(settings, root, args, model))
        if stage == 2:
            metrics.append(_guard(settings, root, args, model))
    return metrics


def _guard(settings: BenchSettings, root: str, args: List[str], model: dict) -> Metric:
    """The divergence guard's cost at its default interval, as a fraction of a step (see the module docstring)."""
    from ftbridge.config import FTBridgeConfig

    every = FTBridgeConfig.guard_every
    per_step, steps = [], []
    for rep in range(settings.reps):
        res = run_ftbridge(next_run_dir(root, "ftbridge_guard_z2"), GROUPS, RANKS, args,
                           timeout_s=settings.timeout_s, env={"FTBRIDGE_GUARD_EVERY": "1"}, rep=rep)
        per_check = max(f["guard_s"] / max(f["guard_checks"], 1) for f in res.finals)
        per_step.append(per_check / every)
        steps.append(steady_median(res.step_times_s, settings.warmup_steps))
        log.info("overhead: divergence guard %.2f ms per check, every %d steps: %.4f %% of a %.1f ms step",
                 per_check * 1e3, every, 100 * per_step[-1] / steps[-1], steps[-1] * 1e3)
    return ratio_metric("overhead", f"divergence guard every {every} steps, ZeRO-2 {GROUPS}x{RANKS}: "
                        "check time per step / step time", per_step, steps,
                        baseline_name="ftbridge median step (guard every step)", target_max=GUARD_TARGET_MAX,
                        extra={"zero_stage": 2, "guard_every": every, "baseline_unit": "s", "model": model,
                               "per_check_s": [p * every for p in per_step], "guard": True})


FEATURES_OFF = {
    "the peer watch off": {"FTBRIDGE_PEER_WATCH": "0"},
    "the ride-through off": {"FTBRIDGE_RIDE_OUT_LIGHTHOUSE_OUTAGE": "0"},
    "both off": {"FTBRIDGE_PEER_WATCH": "0", "FTBRIDGE_RIDE_OUT_LIGHTHOUSE_OUTAGE": "0"},
}
"""The robustness features whose per-step cost the full run attributes (ZeRO-2), by the settings that turn them off."""


def _features_off(settings: BenchSettings, root: str, args: List[str], model: dict) -> List[Metric]:
    """ftbridge ``GROUPS x RANKS``, ZeRO-2, with each of :data:`FEATURES_OFF` / with every feature on.

    Each pair runs back to back in alternating order (fresh runs, none reused), so the ratio is what the
    feature costs a step: below 1 by that share. Informative, no target.
    """
    out = []

    def run(tag: str, env: Dict[str, str], rep: int) -> float:
        res = run_ftbridge(next_run_dir(root, f"ftbridge_z2_{tag}"), GROUPS, RANKS, args,
                           timeout_s=settings.timeout_s, env=env)
        return steady_median(res.step_times_s, settings.warmup_steps)

    for name, env in FEATURES_OFF.items():
        tag = "both_off" if name == "both off" else f"{name.split()[1]}_off"
        log.info("overhead: ZeRO-2, ftbridge %dx%d with %s vs every feature on", GROUPS, RANKS, name)
        cand, base = alternate(settings.reps, functools.partial(run, tag, env), functools.partial(run, "all_on", {}),
                               log.info)
        out.append(ratio_metric("overhead", f"step time ZeRO-2, ftbridge {GROUPS}x{RANKS} with {name} / with every "
                                "feature on", cand, base, baseline_name="ftbridge, every feature on, median step",
                                extra={"zero_stage": 2, "baseline_unit": "s", "model": model, "env": env,
                                       "features_off": True}))
    return out


def _one_group(settings: BenchSettings, root: str, args: List[str], plain, model: dict) -> Metric:
    """ftbridge as 1 group of ``GROUPS * RANKS`` ranks / plain DeepSpeed on as many: the machinery alone.

    Same sharding as the baseline and no other group to all-reduce with, so
    the ratio is ftbridge's per-step bookkeeping (quorum, commit vote, hooks,
    event log) without the two costs of the GROUPS x RANKS topology: the
    optimizer step over a partition ``GROUPS`` times larger (ZeRO shards inside
    a group only) and the cross-replica all-reduce. Informative, no target.
    """
    n = GROUPS * RANKS

    def ftbridge(rep: int) -> float:
        res = run_ftbridge(next_run_dir(root, "ftbridge_1group_z2"), 1, n, args, timeout_s=settings.timeout_s,
                           rep=rep)
        return steady_median(res.step_times_s, settings.warmup_steps)

    log.info("overhead: ZeRO-2, ftbridge 1x%d vs plain DeepSpeed %d ranks (the machinery alone)", n, n)
    cand, base = alternate(settings.reps, ftbridge, plain, log.info)
    return ratio_metric("overhead", f"step time ZeRO-2, ftbridge 1x{n} / plain DS {n} ranks (same sharding)", cand,
                        base, baseline_name=f"plain DeepSpeed {n} ranks, median step",
                        extra={"zero_stage": 2, "groups": 1, "ranks_per_group": n, "baseline_unit": "s",
                               "model": model, "timed_steps": settings.steps, "decomposition": True})
