"""Shared types of the benchmark suite: settings, metrics, statistics and the registry.

A benchmark is a function ``run(settings: BenchSettings) -> List[Metric]``
registered under a short name with :func:`benchmark`; the CLI
(:mod:`ftbridge.harness.bench.cli`) runs the registered ones in order and the report
(:mod:`ftbridge.harness.bench.report`) renders their metrics. A benchmark never
asserts on time: it measures, compares with a baseline measured in the same
invocation, and says whether the target is met.
"""

from __future__ import annotations

import contextlib
import os
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence


@dataclass(frozen=True)
class BenchSettings:
    """How hard to measure; one value for the whole suite.

    Attributes:
        workdir: folder for run logs, event logs and intermediate files.
        quick: CI smoke mode: fewest repetitions and steps, smallest models;
            the figures are noisy and only show the suite runs end to end.
        reps: repetitions per measured configuration (median and spread over them).
        steps: training steps per steady-state run (warm-up excluded).
        warmup_steps: leading steps dropped from every step-time median.
        timeout_s: wall-clock limit of any one job (seconds); a job past it is
            killed by PID and the benchmark fails with its log tail.
        slots: train every ftbridge job of the main job with slots, one per planned replica group
            (``scripts/train_lm.py``'s default: a failure does not change what the job trains on); ``False``
            sets ``FTBRIDGE_SLOTS=0`` (a failure shrinks the global batch). A benchmark that compares the two
            (``slots``) sets its own. Applied by :func:`slots_environment`.
    """

    workdir: str
    quick: bool = False
    reps: int = 3
    steps: int = 60
    warmup_steps: int = 10
    timeout_s: float = 600.0
    slots: bool = True

    def __post_init__(self) -> None:
        if self.reps < 1:
            raise ValueError(f"reps={self.reps}: need at least 1 repetition")
        if self.steps <= 0 or self.warmup_steps < 0:
            raise ValueError(f"steps={self.steps}, warmup_steps={self.warmup_steps}: steps must be > 0, warm-up >= 0")


@contextlib.contextmanager
def slots_environment(settings: BenchSettings, environ: Any = os.environ) -> Iterator[None]:
    """While open, ``FTBRIDGE_SLOTS`` in ``environ`` (this process's, which every job started meanwhile inherits)
    says ``settings.slots``: empty (the main job's default, one slot per planned replica group) or ``0`` (off).
    The previous value (or its absence) is restored on exit."""
    previous = environ.get("FTBRIDGE_SLOTS")
    environ["FTBRIDGE_SLOTS"] = "" if settings.slots else "0"
    try:
        yield
    finally:
        if previous is None:
            environ.pop("FTBRIDGE_SLOTS", None)
        else:
            environ["FTBRIDGE_SLOTS"] = previous


@dataclass
class Metric:
    """One figure of the report: a measured value against its baseline.

    Attributes:
        benchmark: registered benchmark name (``overhead``, ``heal``, ...).
        name: what was measured, e.g. ``"step time ZeRO-2, 2x2 vs plain DS 4 ranks"``.
        value: median of ``samples`` (``unit``).
        unit: ``"ratio"``, ``"s"``, ``"steps"``, ``"bytes"``, ``"MiB"``, ``"MB/s"`` ...
        samples: every repetition's value, same unit.
        baseline: median of the baseline's samples in ``unit`` of the baseline
            (``None`` when the metric is itself a ratio or count without one).
        baseline_name: what the baseline is, e.g. ``"plain DeepSpeed 4 ranks"``.
        target: the target's text, e.g. ``"<= 1.03"``; ``None`` when informative only.
        met: whether the median meets the target; ``None`` without a target.
        extra: anything the plot or the note needs (per-phase times, sizes).
    """

    benchmark: str
    name: str
    value: float
    unit: str
    samples: List[float] = field(default_factory=list)
    baseline: Optional[float] = None
    baseline_name: Optional[str] = None
    target: Optional[str] = None
    met: Optional[bool] = None
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def spread(self) -> float:
        """Half the range of the samples (max - min) / 2, in ``unit``; 0 for one sample."""
        return (max(self.samples) - min(self.samples)) / 2 if len(self.samples) > 1 else 0.0

    def to_json(self) -> Dict[str, Any]:
        d = asdict(self)
        d["spread"] = self.spread
        return d


def median(values: Sequence[float]) -> float:
    """Median of ``values``; raises ``ValueError`` naming the empty input."""
    if not values:
        raise ValueError("median of no values: the benchmark produced no samples")
    return float(statistics.median(values))


def ratio_metric(benchmark: str, name: str, samples: Sequence[float], baseline_samples: Sequence[float], *,
                 baseline_name: str, target_max: Optional[float] = None, target_min: Optional[float] = None,
                 paired: bool = True, extra: Optional[Dict[str, Any]] = None) -> Metric:
    """A ``ratio`` metric: ``samples`` over ``baseline_samples``.

    With ``paired`` (repetitions alternate candidate and baseline), the
    per-repetition ratios ``samples[i] / baseline_samples[i]`` are the samples;
    otherwise the ratio of medians is the single sample. ``target_max`` /
    ``target_min`` set the target (``<=`` / ``>=``). Raises ``ValueError`` if a
    baseline sample is not positive or paired lists differ in length.
    """
    if any(not (b > 0) for b in baseline_samples):
        raise ValueError(f"baseline samples {list(baseline_samples)} must be > 0 to form a ratio")
    if paired:
        if len(samples) != len(baseline_samples):
            raise ValueError(f"paired ratio needs equal repetitions, got {len(samples)} and {len(baseline_samples)}")
        ratios = [s / b for s, b in zip(samples, baseline_samples)]
    else:
        ratios = [median(samples) / median(baseline_samples)]
    value = median(ratios)
    target, met = None, None
    if target_max is not None:
        target, met = f"<= {target_max:g}", value <= target_max
    elif target_min is not None:
        target, met = f">= {target_min:g}", value >= target_min
    return Metric(benchmark, name, value, "ratio", ratios, median(baseline_samples), baseline_name, target, met,
                  dict(extra or {}, candidate_samples=list(samples), baseline_samples=list(baseline_samples)))


BenchFn = Callable[[BenchSettings], List[Metric]]
PlotFn = Callable[[List[Metric], str], None]

# Benchmark modules, imported by the CLI in this order; each registers itself with @benchmark.
MODULES: tuple = (
    "ftbridge.harness.bench.overhead",   # 1. steady-state step time vs plain DeepSpeed
    "ftbridge.harness.bench.overlap",    # 2. per-bucket vs post-backward sync
    "ftbridge.harness.bench.failover",   # 3. survivor stall after a group is killed
    "ftbridge.harness.bench.heal",       # 4. restart to first commit, by phase; transfer vs loopback
    "ftbridge.harness.bench.restart",    # 5. against plain DeepSpeed under torchrun restarts
    "ftbridge.harness.bench.rescale",    # 6. resume at another number of groups vs universal checkpoint
    "ftbridge.harness.bench.memory",     # 7. peak RSS vs plain DeepSpeed
    "ftbridge.harness.bench.scaling",    # 8. cross-replica cost vs groups and model size
    "ftbridge.harness.bench.outage",     # 9. steps lost to a lighthouse outage, riding it out vs waiting
    "ftbridge.harness.bench.spare",      # 10. warm spare vs cold restart: drop -> full capacity
    "ftbridge.harness.bench.straggler",  # 11. job step rate with one group at half speed
    "ftbridge.harness.bench.slots",      # 12. exact training's step time, all groups live and one dead
)

REGISTRY: Dict[str, BenchFn] = {}
PLOTS: Dict[str, PlotFn] = {}


def save_figure(fig: Any, path: str) -> None:
    """Lay out, write (PNG, 120 dpi) and close a matplotlib figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def paired_bars(ax: Any, metrics: List[Metric], scale: float = 1.0, color: str = "tab:blue") -> None:
    """Per ZeRO stage, bars of the baseline's and ftbridge's median sample (x ``scale``), whiskers min..max.

    For ratio metrics whose ``extra`` holds ``baseline_samples``, ``candidate_samples`` and
    ``zero_stage`` (:func:`ratio_metric` with paired repetitions); each pair is labelled with its ratio.
    """
    for i, m in enumerate(metrics):
        for j, (key, label, c) in enumerate((("baseline_samples", "plain DeepSpeed", "tab:gray"),
                                             ("candidate_samples", "ftbridge", color))):
            vals = sorted(v * scale for v in m.extra[key])
            mid = vals[len(vals) // 2]
            ax.bar(i + (j - 0.5) * 0.38, mid, 0.36, color=c, label=label if i == 0 else None,
                   yerr=[[mid - vals[0]], [vals[-1] - mid]], capsize=3)
        ax.text(i, max(m.extra["candidate_samples"] + m.extra["baseline_samples"]) * scale * 1.04,
                f"{m.value:.3f}x", ha="center", fontsize=9)
    ax.set_xticks(range(len(metrics)), [f"ZeRO-{m.extra['zero_stage']}" + (
        f"\n1 group x {m.extra['ranks_per_group']}" if m.extra.get("decomposition") else "") for m in metrics])


def benchmark(name: str, plot: Optional[PlotFn] = None) -> Callable[[BenchFn], BenchFn]:
    """Decorator: register ``fn`` as the benchmark ``name``.

    ``plot(metrics, png_path)``, if given, draws that benchmark's figure from
    its own metrics (the report calls it after the run). Raises ``ValueError``
    if ``name`` is registered twice.
    """
    def register(fn: BenchFn) -> BenchFn:
        if name in REGISTRY:
            raise ValueError(f"benchmark {name!r} registered twice")
        REGISTRY[name] = fn
        if plot is not None:
            PLOTS[name] = plot
        return fn
    return register
