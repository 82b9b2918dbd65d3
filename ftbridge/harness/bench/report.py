"""The benchmark report: ``bench.json``, ``bench.md`` and PNG plots in one folder.

* ``bench.json``: the settings, the environment (Python, torch, deepspeed,
  torchft versions, CPU count), every metric (:meth:`Metric.to_json`), the
  failed benchmarks with their error text, and how long each benchmark took;
* ``bench.md``: one Markdown table row per metric (benchmark, metric,
  median, spread, samples, baseline, target, met / NOT met / —), the failures,
  and the metrics' notes;
* ``<benchmark>.png``: each benchmark's own plot (``core.PLOTS``), and
  ``overview.png``: every ratio metric that has a target, its median and
  min..max against the target.

matplotlib runs with the Agg backend (no display). A plot that raises is
recorded in ``plot_errors`` of ``bench.json`` and does not stop the others.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import textwrap
import traceback
from dataclasses import asdict
from importlib import metadata
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ftbridge.harness.bench.core import PLOTS, BenchSettings, Metric, save_figure


def environment() -> Dict[str, Any]:
    """Versions and machine facts that decide the numbers (a missing package reads ``None``)."""
    def version(pkg: str) -> Optional[str]:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    return {"python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
            **{pkg: version(pkg) for pkg in ("torch", "deepspeed", "torchft", "ftbridge")},
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}


def failure(name: str, exc: BaseException, duration_s: float) -> Dict[str, Any]:
    """A failed benchmark's entry: its name, the error's type and text, the traceback, time spent (seconds)."""
    return {"benchmark": name, "error": f"{type(exc).__name__}: {exc}",
            "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
            "duration_s": duration_s}


def _num(value: Optional[float], unit: str = "") -> str:
    if value is None:
        return "—"
    if not math.isfinite(value):
        return str(value)
    text = f"{value:.3f}" if unit == "ratio" or abs(value) < 100 else f"{value:.1f}"
    return text + ("" if unit in ("", "ratio") else f" {unit}")


def _verdict(m: Metric) -> str:
    return "—" if m.met is None else ("met" if m.met else "**NOT met**")


def render_markdown(settings: BenchSettings, env: Dict[str, Any], metrics: Sequence[Metric],
                    failures: Sequence[Dict[str, Any]]) -> str:
    """``bench.md``: a header with settings and versions, the table, failures and notes."""
    lines = ["# ftbridge benchmarks", "",
             f"{'Quick (CI smoke) run: figures are noisy. ' if settings.quick else ''}"
             f"{settings.reps} repetition(s), {settings.steps} timed steps after {settings.warmup_steps} "
             f"warm-up steps per run, slots {'on' if settings.slots else 'off'}. "
             f"torch {env.get('torch')}, deepspeed {env.get('deepspeed')}, "
             f"torchft {env.get('torchft')}, {env.get('cpu_count')} CPU(s).", "",
             "| benchmark | metric | median | spread (±) | n | baseline | target | target met |",
             "|---|---|---|---|---|---|---|---|"]
    for m in metrics:
        base_unit = m.extra.get("baseline_unit", "" if m.unit == "ratio" else m.unit)
        baseline = "—" if m.baseline is None else f"{_num(m.baseline, base_unit)} ({m.baseline_name})"
        lines.append(f"| {m.benchmark} | {m.name} | {_num(m.value, m.unit)} | {_num(m.spread, m.unit)} | "
                     f"{len(m.samples)} | {baseline} | {m.target or '—'} | {_verdict(m)} |")
    for f in failures:
        first = f["error"].splitlines()[0] if f["error"] else ""
        lines.append(f"| {f['benchmark']} | FAILED: {first.replace('|', '/')[:160]} | — | — | 0 | — | — | "
                     "**failed** |")
    notes = [f"- {m.benchmark}, {m.name}: {m.extra['note']}" for m in metrics if m.extra.get("note")]
    if notes:
        lines += ["", "Notes:", "", *notes]
    if failures:
        lines += ["", "## Failures", ""]
        for f in failures:
            lines += [f"### {f['benchmark']} (after {f['duration_s']:.1f} s)", "", "```",
                      f["error"][-3000:], "```", ""]
    missed = [m for m in metrics if m.met is False]
    lines += ["", f"{sum(m.met is True for m in metrics)} target(s) met, {len(missed)} not met, "
                  f"{len(failures)} benchmark(s) failed."]
    return "\n".join(lines) + "\n"


def _target_value(target: Optional[str]) -> Optional[float]:
    match = re.search(r"[-+]?\d*\.?\d+(?:[eE][-+]?\d+)?", target or "")
    return float(match.group()) if match else None


def plot_overview(metrics: Sequence[Metric], path: str) -> bool:
    """Horizontal bars of every ratio metric with a target: median, min..max whiskers, the target marked.

    Returns:
        ``False`` (and writes nothing) when no metric is a ratio with a target.
    """
    import matplotlib.pyplot as plt

    ms = [m for m in metrics if m.unit == "ratio" and _target_value(m.target) is not None]
    if not ms:
        return False
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(ms) + 1.4))
    for i, m in enumerate(ms):
        color = "tab:green" if m.met else "tab:red"
        ax.barh(i, m.value, color=color, alpha=0.7,
                xerr=[[m.value - min(m.samples)], [max(m.samples) - m.value]], capsize=3)
        target = _target_value(m.target)
        assert target is not None  # ms keeps only metrics with a target
        ax.plot([target, target], [i - 0.4, i + 0.4], color="black", lw=2)
        ax.text(max(*m.samples, target) * 1.02 + 0.02, i, f"{m.value:.3f} (target {m.target})", va="center",
                fontsize=7)
    # Wrapped, not cut: two metrics may differ only at the end of the name (the restart ratios' timeouts).
    ax.set_yticks(range(len(ms)), ["\n".join(textwrap.wrap(f"{m.benchmark}: {m.name}", 62)) for m in ms], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ratio (median over repetitions; black: target; green met, red not met)")
    ax.set_xlim(0, max(max(*m.samples, _target_value(m.target) or 0) for m in ms) * 1.35)
    save_figure(fig, path)
    return True


def write_plots(metrics: Sequence[Metric], out_dir: str) -> Dict[str, Any]:
    """Each registered benchmark plot with metrics, then the overview; errors are collected, not raised.

    Returns:
        ``{"files": [png paths], "errors": {plot name: error text}}``.
    """
    import matplotlib

    matplotlib.use("Agg")
    files, errors = [], {}
    names = list(dict.fromkeys(m.benchmark for m in metrics))

    def job(n: str) -> Callable[[str], Any]:
        return lambda p: PLOTS[n]([m for m in metrics if m.benchmark == n], p)

    jobs: List[Tuple[str, Callable[[str], Any]]] = [(n, job(n)) for n in names if n in PLOTS]
    jobs.append(("overview", lambda p: plot_overview(metrics, p)))
    for name, draw in jobs:
        path = os.path.join(out_dir, f"{name}.png")
        try:
            if draw(path) is not False:
                files.append(path)
        except Exception as exc:  # noqa: BLE001 - one broken plot must not lose the report
            errors[name] = f"{type(exc).__name__}: {exc}"
    return {"files": files, "errors": errors}


def write_report(out_dir: str, settings: BenchSettings, metrics: Sequence[Metric],
                 failures: Sequence[Dict[str, Any]], durations_s: Optional[Dict[str, float]] = None) -> Dict[str, Any]:
    """Write ``bench.json``, ``bench.md`` and the plots to ``out_dir`` (created).

    Args:
        settings: the run's settings.
        metrics: every metric, in benchmark order.
        failures: :func:`failure` entries of the benchmarks that raised.
        durations_s: wall time per benchmark, seconds.

    Returns:
        The ``bench.json`` record, with ``files`` (paths written).
    """
    os.makedirs(out_dir, exist_ok=True)
    env = environment()
    plots = write_plots(metrics, out_dir)
    record = {"settings": asdict(settings), "environment": env, "metrics": [m.to_json() for m in metrics],
              "failures": list(failures), "durations_s": dict(durations_s or {}), "plot_errors": plots["errors"]}
    md_path, json_path = os.path.join(out_dir, "bench.md"), os.path.join(out_dir, "bench.json")
    with open(md_path, "w", encoding="utf-8") as f:
        f.write(render_markdown(settings, env, metrics, failures))
    record["files"] = [json_path, md_path, *plots["files"]]
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2, default=str)
    return record
