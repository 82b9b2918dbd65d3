"""Slots: what exact training costs per step, with every group live and with one group dead.

Two replica groups x 1 rank, ZeRO-2, ``G = 2`` micro-batches per slot, in the same invocation:

* **slots on** (``FTBRIDGE_SLOTS=2``): both groups train together, then group 1 is SIGKILLed without
  a restart and group 0 computes both slots' units alone;
* **slots off** (baseline): the same schedule; group 0 alone then trains only its own micro-batches.

Reported, from group 0 rank 0's step records (``step_time_s``, committed steps only; the first
``warmup`` committed steps and the first committed step after the kill are left out):

* **degraded step time, slots on / off**: with one live group, the survivor computes both slots' 4
  units with slots on and its own 2 with them off; ideal ``ceil(N * G / P) / G`` = 2.0
  (:func:`ftbridge.slots.max_load`). Target <= 2.2: a degraded step costs its extra units and little
  else. (Against the same run's full steps the ratio says less: a full step also waits for the peer
  and the all-reduce, which a lone group skips.)
* **full step time, slots on / off**: what the slot plan (the in-group plan exchange, the plan digest
  in the agreement) adds to a step with no failure. Target <= 1.05.
* **degraded / full step time, slots on** (informative).

Not run with ``--quick`` in the default suite's subset (``tests/integration/test_bench_quick.py``);
``tests/integration/test_slots.py`` checks the exactness of the same path.
"""

from __future__ import annotations

import os
import time
from typing import Any, Dict, List, Sequence

from ftbridge.harness.bench import failure_jobs
from ftbridge.harness.bench.core import BenchSettings, Metric, benchmark, median, ratio_metric, save_figure
from ftbridge.harness.local_job import LocalJob
from ftbridge.slots import max_load

NAME = "slots"
SLOTS, MICRO = 2, 2
"""Slots (= replica groups) and micro-batches per slot of the runs."""
IDEAL = max_load(SLOTS, MICRO, 1) / MICRO
"""Ideal degraded step time, slots on / off, with one of the two groups live: ``ceil(N * G / P) / G``."""


def phase_step_times(records: Sequence[Dict[str, Any]], kill_time: float, warmup: int) -> Dict[str, float]:
    """Median step time of one rank before and after a kill (pure).

    Args:
        records: the rank's step records (``time``, ``committed``, ``participants``, ``step_time_s``).
        kill_time: wall time of the SIGKILL (s since the epoch).
        warmup: committed steps left out at the start.

    Returns:
        ``full_s``: median over committed steps before the kill, with the most participants, after
        ``warmup``; ``degraded_s``: median over committed steps after the kill with fewer
        participants, the first left out (it holds the failure's stall).

    Raises:
        ValueError: no step in one of the phases.
    """
    done = sorted((r for r in records if r["committed"]), key=lambda r: r["time"])
    before = [r for r in done if r["time"] <= kill_time]
    full = max((r["participants"] for r in before), default=0)
    full_times = [r["step_time_s"] for r in before[warmup:] if r["participants"] == full]
    degraded = [r["step_time_s"] for r in done if r["time"] > kill_time and r["participants"] < full][1:]
    if not full_times or not degraded:
        raise ValueError(f"{len(full_times)} full steps before the kill and {len(degraded)} degraded steps after "
                         "it: the run is too short to compare")
    return {"full_s": median(full_times), "degraded_s": median(degraded)}


def kill_run(workdir: str, settings: BenchSettings, slots: int) -> Dict[str, float]:
    """One run of the module's schedule; group 0 rank 0's :func:`phase_step_times`.

    Raises:
        TimeoutError: a wait exceeded ``settings.timeout_s``.
        RuntimeError: group 0 did not exit 0.
    """
    t_out, warm = settings.timeout_s, failure_jobs.warm_steps(settings)
    args = [*failure_jobs.model_args(settings), "--grad-accum", str(MICRO), "--steps", "1000000",
            "--stop-file", os.path.join(workdir, "stop")]
    job = LocalJob(workdir, 2, 1, args, max_restarts=0, env={"OMP_NUM_THREADS": "1", "FTBRIDGE_SLOTS": str(slots)},
                   checksum_every=None)
    with job:
        job.start()
        job.wait_until(lambda: all(sum(e["committed"] and e["participants"] == 2 for e in job.steps(g))
                                   >= warm + settings.steps for g in (0, 1)), t_out, "both groups to train together")
        kill_time = time.time()
        job.kill_workers(1)
        job.wait_until(lambda: sum(e["committed"] and e["participants"] == 1 and e["time"] > kill_time
                                   for e in job.steps(0)) >= settings.steps + 1, t_out, "group 0 to train alone")
        job.stop_soon()
        code = job.wait(t_out, groups=[0])[0]
        if code != 0:
            raise RuntimeError(f"group 0 of the slots={slots} run in {workdir} exited {code}:\n{job.tails()}")
        return phase_step_times(job.steps(0), kill_time, warm)


def plot(metrics: List[Metric], png_path: str) -> None:
    """Bars: median full and degraded step time, slots on and off, with the ideal degraded time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = next(m for m in metrics if m.name.startswith("degraded step time, slots on / off")).extra["runs"]
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    off_degraded = median([r["degraded_s"] for r in runs["off"]])
    for i, key in enumerate(("on", "off")):
        full = median([r["full_s"] for r in runs[key]])
        degraded = median([r["degraded_s"] for r in runs[key]])
        ax.bar([i - 0.2], [full], 0.4, color="tab:blue", label="both groups live" if i == 0 else None)
        ax.bar([i + 0.2], [degraded], 0.4, color="tab:orange", label="one group live" if i == 0 else None)
        if key == "on":
            ax.hlines(IDEAL * off_degraded, i, i + 0.4, colors="black", linestyles="dashed",
                      label=f"ideal: {IDEAL:g} x slots off")
    ax.set_xticks([0, 1], [f"slots on (N={SLOTS})", "slots off"])
    ax.set_ylabel("median step time (s)")
    ax.set_title(f"2 groups, G={MICRO}: a group's death with and without slots")
    ax.set_ylim(0, 1.45 * max(ax.get_ylim()[1], IDEAL * off_degraded))
    ax.legend(loc="upper center", ncol=3, fontsize=7)
    save_figure(fig, png_path)


@benchmark(NAME, plot=plot)
def run(settings: BenchSettings) -> List[Metric]:
    """Slots on and off, alternating, ``settings.reps`` runs each (1 in quick mode); see the module docstring.

    Raises:
        TimeoutError, RuntimeError, ValueError: a run failed (:func:`kill_run`, :func:`phase_step_times`).
    """
    reps = 1 if settings.quick else settings.reps
    runs: Dict[str, List[Dict[str, float]]] = {"on": [], "off": []}
    for i in range(reps):
        for key, slots in (("on", SLOTS), ("off", 0)):
            runs[key].append(kill_run(os.path.join(settings.workdir, NAME, f"{key}_rep{i}"), settings, slots))
    on, off = runs["on"], runs["off"]
    return [
        ratio_metric(NAME, "degraded step time, slots on / off (one of 2 groups live)",
                     [r["degraded_s"] for r in on], [r["degraded_s"] for r in off],
                     baseline_name=f"slots off, same invocation; ideal ceil(N*G/P)/G = {IDEAL:g}",
                     target_max=1.1 * IDEAL, extra={"runs": runs, "ideal": IDEAL}),
        ratio_metric(NAME, "full step time, slots on / off", [r["full_s"] for r in on], [r["full_s"] for r in off],
                     baseline_name="slots off, same invocation", target_max=1.05),
        ratio_metric(NAME, "degraded / full step time, slots on", [r["degraded_s"] for r in on],
                     [r["full_s"] for r in on], baseline_name="slots on, both groups live"),
    ]
