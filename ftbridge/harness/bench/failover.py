"""Survivor stall: what a SIGKILL of a whole replica group costs the groups that live on.

Two replica groups (:data:`~ftbridge.harness.bench.failure_jobs.RANKS_PER_GROUP`
ranks each) train until they commit together; every rank of group 1 is then
SIGKILLed (:func:`~ftbridge.harness.bench.failure_jobs.ftbridge_kill_runs`). From the
survivors' event log:

* **stall**: kill to the survivors' first committed step whose quorum no
  longer holds the dead group (``participants`` below the count at the kill).
  A step already in flight may still commit with the old quorum; it is not
  progress past the failure, so it does not end the stall.
* **discarded**: survivor steps after the kill that were not committed, up to
  that commit.
* **committed steps lost**: steps the killed group had committed before the
  kill that the job no longer holds once it comes back: its last commit
  before the kill against the step it resumed from (its first commit after
  the kill, minus one; a group restarted from scratch resumes from 0), from
  :func:`killed_group_steps_lost`; must be 0. The survivors' own step
  counter going back (:func:`committed_steps_lost`) is reported beside it.
  Either counts only for a run that ended identical across groups with exit
  0 (:func:`~ftbridge.harness.bench.failure_jobs.check_recovered`).

Target: stall <= heartbeat timeout + one median step (the lighthouse
declares the group dead after one heartbeat timeout, then one step runs),
reported as the ratio stall / bound <= 1.0.

**Hang variant** (full mode only; the quick CI run skips
it): group 1 is SIGSTOPped instead of killed
(:func:`~ftbridge.harness.bench.failure_jobs.ftbridge_hang_runs`), once with the
peer watch on (:mod:`ftbridge.manager.quorum_watch`) and once off
(``FTBRIDGE_PEER_WATCH=0``, the behaviour before it: the survivors wait out
the cross-replica timeout), in the same invocation. Same figures, prefixed
``hang:``, with the watch-off stall as the baseline.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from ftbridge.harness.bench import failure_jobs
from ftbridge.harness.bench.core import BenchSettings, Metric, benchmark, median, save_figure

NAME = "failover"


def committed_steps_lost(records: Sequence[Dict[str, Any]]) -> int:
    """Committed steps of one replica group that a later commit repeats (the step counter going back).

    Args:
        records: step records of one rank (``step``, ``committed``, ``time``),
            any order; several launches of the group may be mixed in.

    Returns:
        Sum over committed records of ``max committed step so far - step + 1``
        where that is positive (a commit of step ``s`` after ``m >= s`` means
        steps ``s .. m`` were done twice). 0 when the counter only rises.
    """
    lost, top = 0, None
    for r in sorted(records, key=lambda r: r["time"]):
        if not r["committed"]:
            continue
        if top is not None and r["step"] <= top:
            lost += top - r["step"] + 1
        top = r["step"] if top is None else max(top, r["step"])
    return lost


def killed_group_steps_lost(records: Sequence[Dict[str, Any]], kill_time: float, killed: int = 1) -> int:
    """Committed steps of the killed group that the job lost by the time that group committed again.

    Args:
        records: step records of the job (``replica_group``, ``group_rank``,
            ``time``, ``step`` after the step, ``committed``); group rank 0 counts.
        kill_time: wall time of the SIGKILL (s since the epoch).
        killed: the replica group that was killed.

    Returns:
        ``max(0, K - R)``: ``K`` the killed group's last committed step before
        the kill, ``R`` the step it resumed from (its first commit after the
        kill, minus one). A heal from a live peer resumes at or past ``K``.

    Raises:
        ValueError: the killed group committed nothing before, or nothing after, the kill.
    """
    mine = sorted((r for r in records if "event" not in r and r["replica_group"] == killed
                   and r["group_rank"] == 0 and r["committed"]), key=lambda r: r["time"])
    before = [r["step"] for r in mine if r["time"] <= kill_time]
    after = [r["step"] for r in mine if r["time"] > kill_time]
    if not before or not after:
        raise ValueError(f"replica group {killed} committed {len(before)} steps before and {len(after)} after "
                         f"the kill at {kill_time:.3f}: nothing to compare")
    return max(0, max(before) - (after[0] - 1))


def survivor_stall(records: Sequence[Dict[str, Any]], kill_time: float) -> Dict[str, float]:
    """Stall and discarded steps of one survivor rank after a kill at ``kill_time``.

    Args:
        records: that rank's step records (``time`` s since the epoch, ``step``,
            ``committed``, ``participants``, ``step_time_s``).
        kill_time: wall time of the SIGKILL (s since the epoch).

    Returns:
        ``stall_s`` (kill to the first commit with fewer participants than the
        last record before the kill), ``discarded`` (uncommitted steps in
        between), ``step_time_s`` (median ``step_time_s`` of committed steps
        before the kill, warm-up step excluded; with slots, times the units that first commit computed over
        the median units of those steps: the survivor's first step computes the dead group's units too,
        ``ceil(N * G / P)`` of them) and ``lost`` (:func:`committed_steps_lost`).

    Raises:
        ValueError: no record before the kill, or no such commit after it.
    """
    recs = sorted(records, key=lambda r: r["time"])
    before = [r for r in recs if r["time"] <= kill_time]
    if not before:
        raise ValueError(f"no step record before the kill at {kill_time:.3f}: the run failed before it")
    members = before[-1]["participants"]
    after = [r for r in recs if r["time"] > kill_time]
    first = next((r for r in after if r["committed"] and r["participants"] < members), None)
    if first is None:
        raise ValueError(f"no commit without the killed group after the kill at {kill_time:.3f} "
                         f"({len(after)} records after it)")
    discarded = sum(1 for r in after if r["time"] <= first["time"] and not r["committed"])
    times = [r["step_time_s"] for r in before if r["committed"]]
    units = [len(r["units"]) for r in before if r["committed"] and r.get("units")]
    load = len(first["units"]) / median(units) if units and first.get("units") else 1.0
    return {"stall_s": first["time"] - kill_time, "discarded": float(discarded),
            "step_time_s": median(times[1:] or times) * load, "lost": float(committed_steps_lost(recs))}


def count_metric(name: str, samples: Sequence[float], target_max: Optional[float], *, bench: str = NAME,
                 baseline: Optional[float] = None, baseline_name: Optional[str] = None) -> Metric:
    """A ``steps`` count; its target (``None``: informative) holds only if *every* repetition is ``<= target_max``."""
    if target_max is None:
        return Metric(bench, name, median(samples), "steps", list(samples), baseline, baseline_name)
    return Metric(bench, name, median(samples), "steps", list(samples), baseline, baseline_name,
                  f"<= {target_max:g} (every rep)", max(samples) <= target_max)


def stall_metrics(bench: str, runs: Sequence[failure_jobs.KillRun], survivor: int = 0, killed: int = 1,
                  prefix: str = "", baseline_runs: Sequence[failure_jobs.KillRun] = (),
                  baseline_name: str = "") -> List[Metric]:
    """Stall ratio, stall seconds, discarded and lost counts over ``runs`` (one survivor rank per run).

    Args:
        prefix: put before every metric name (``"hang: "``).
        baseline_runs: the same failure under another configuration; their median survivor stall
            (s) becomes the stall metric's baseline, named ``baseline_name``.
    """
    stats = [survivor_stall([e for e in r.events if "event" not in e and e["replica_group"] == survivor
                             and e["group_rank"] == 0], r.kill_time) for r in runs]
    bounds = [r.heartbeat_timeout_s + s["step_time_s"] for r, s in zip(runs, stats)]
    stalls = [s["stall_s"] for s in stats]
    ratio = [s / b for s, b in zip(stalls, bounds)]
    base = [survivor_stall([e for e in r.events if "event" not in e and e["replica_group"] == survivor
                            and e["group_rank"] == 0], r.kill_time)["stall_s"] for r in baseline_runs]
    out = [
        Metric(bench, prefix + "survivor stall / (heartbeat timeout + 1 step)", median(ratio), "ratio", ratio,
               median(bounds), "heartbeat timeout + median step (with slots, of the survivor's units)", "<= 1",
               median(ratio) <= 1.0,
               {"stall_s": stalls, "bound_s": bounds, "heartbeat_timeout_s": runs[0].heartbeat_timeout_s,
                "step_time_s": [s["step_time_s"] for s in stats]}),
        Metric(bench, prefix + "survivor stall", median(stalls), "s", stalls, median(base) if base else None,
               baseline_name or None, extra={"baseline_s": base} if base else {}),
        count_metric(prefix + "survivor steps discarded", [s["discarded"] for s in stats], 1, bench=bench),
        count_metric(prefix + "committed steps lost (the killed group's commits, against the step it resumed from)",
                     [float(killed_group_steps_lost(r.events, r.kill_time, killed)) for r in runs], 0, bench=bench),
        count_metric(prefix + "survivor commits repeated (step counter going back)", [s["lost"] for s in stats], 0,
                     bench=bench),
    ]
    return out


def plot(metrics: List[Metric], png_path: str) -> None:
    """Bar per repetition: survivor stall against its bound (heartbeat timeout + one step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = next(m for m in metrics if m.unit == "ratio")
    stalls, bounds = m.extra["stall_s"], m.extra["bound_s"]
    xs = range(len(stalls))
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar([x - 0.2 for x in xs], stalls, 0.4, label="survivor stall")
    ax.bar([x + 0.2 for x in xs], bounds, 0.4, label="heartbeat timeout + 1 step")
    ax.set_xticks(list(xs), [f"rep {x + 1}" for x in xs])
    ax.set_ylabel("seconds")
    ax.set_title("Kill of one replica group: survivors' stall")
    ax.legend()
    save_figure(fig, png_path)


@benchmark(NAME, plot=plot)
def run(settings: BenchSettings) -> List[Metric]:
    """Survivor stall over ``settings.reps`` kill runs (1 in quick mode); see the module docstring.

    Raises:
        TimeoutError: a run stage exceeded ``settings.timeout_s``.
        ValueError: a run has no commit after the kill.
    """
    metrics = stall_metrics(NAME, failure_jobs.ftbridge_kill_runs(settings))
    if not settings.quick:
        off = failure_jobs.ftbridge_hang_runs(settings, peer_watch=False)
        on = failure_jobs.ftbridge_hang_runs(settings, peer_watch=True)
        metrics += stall_metrics(NAME, on, prefix="hang: ", baseline_runs=off,
                                 baseline_name="peer watch off (FTBRIDGE_PEER_WATCH=0), same invocation")
    return metrics
