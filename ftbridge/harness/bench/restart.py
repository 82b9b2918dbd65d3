"""ftbridge against plain DeepSpeed with torchrun restarts from checkpoints.

The same failure (SIGKILL of a training process) handled two ways:

* **plain DeepSpeed** on 2 ranks under torchrun ``--max-restarts 1`` (c10d
  rendezvous, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), DeepSpeed
  ``save_checkpoint`` every N steps (10; 4 in quick mode) and
  ``load_checkpoint`` of the latest on start
  (:func:`~ftbridge.harness.bench.failure_jobs.plain_kill_run`). The kill lands N/2
  steps after a checkpoint. torchrun ends the other rank and restarts both.
* **ftbridge**, 2 replica groups x 1 rank: group 1 is SIGKILLed; group 0 goes
  on; torchrun restarts group 1, which heals (the kill runs shared with the
  failover and heal benchmarks, lighthouse heartbeat timeout 2 s). The
  survivors wait out the heartbeat timeout, so full runs repeat the kill with
  a 0.5 s timeout (:data:`~ftbridge.harness.bench.failure_jobs.FAST_HEARTBEAT_TIMEOUT_MS`)
  and report both ratios.

Measured: time until training resumes (plain: kill .. first step completed
after the restart; ftbridge: kill .. the survivors' first commit without the
dead group, and kill .. the restarted group's first commit) and steps of work
lost (plain: last step before the kill minus the step loaded; ftbridge:
survivor steps discarded plus committed steps lost).

Targets: plain / ftbridge (survivors) resume time >= 10 (the favourable
comparison: the survivors never restart); the like-for-like one, plain restart
/ ftbridge's restarted group back (both a process restart), >= 1.0, reported
beside it; ftbridge loses <= 1 step in every repetition (0 committed). The
ftbridge runs count only if they ended identical across groups with exit 0,
the plain runs only with exit 0 (:mod:`ftbridge.harness.bench.failure_jobs`).
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Sequence

from ftbridge.harness.bench import failure_jobs
from ftbridge.harness.bench.core import BenchSettings, Metric, benchmark, median, ratio_metric, save_figure
from ftbridge.harness.bench.failover import committed_steps_lost, count_metric, killed_group_steps_lost, survivor_stall

NAME = "restart"


def plain_resume(events: Sequence[Dict[str, Any]], kill_time: float) -> Dict[str, float]:
    """Resume time and steps lost of a plain DeepSpeed job restarted by torchrun after a kill.

    Args:
        events: the records of one rank (all launches): step records and
            ``checkpoint_loaded`` events.
        kill_time: wall time of the SIGKILL (s since the epoch).

    Returns:
        ``resume_s`` (kill .. first step record after it), ``lost`` (last step
        before the kill minus the step the restart started from: the loaded
        checkpoint's step, or 0 without one).

    Raises:
        ValueError: no step before or after the kill.
    """
    ev = sorted(events, key=lambda e: e["time"])
    steps_before = [e["step"] for e in ev if "event" not in e and e["time"] <= kill_time]
    after = [e for e in ev if "event" not in e and e["time"] > kill_time]
    if not steps_before or not after:
        raise ValueError(f"plain run: {len(steps_before)} steps before and {len(after)} after the kill")
    loaded = [e["step"] for e in ev if e.get("event") == "checkpoint_loaded" and e["time"] > kill_time]
    resumed_from = loaded[0] if loaded else 0
    return {"resume_s": after[0]["time"] - kill_time, "lost": float(max(steps_before) - resumed_from)}


def ftbridge_resume(events: Sequence[Dict[str, Any]], kill_time: float, killed: int = 1) -> Dict[str, float]:
    """Resume times and work lost of an ftbridge kill run (survivor group 0, rank 0; killed group ``killed``).

    Returns:
        ``survivors_s`` (see :func:`~ftbridge.harness.bench.failover.survivor_stall`),
        ``rejoined_s`` (kill .. the killed group's first commit after it),
        ``lost`` (survivor steps discarded + ``committed_lost``), ``committed_lost`` (the
        killed group's commits the job no longer held when it came back,
        :func:`~ftbridge.harness.bench.failover.killed_group_steps_lost`, plus the
        survivors' repeated commits).

    Raises:
        ValueError: a group has no commit after the kill.
    """
    steps = [e for e in events if "event" not in e and e["group_rank"] == 0]
    surv = survivor_stall([e for e in steps if e["replica_group"] != killed], kill_time)
    back = sorted(e["time"] for e in steps if e["replica_group"] == killed and e["committed"] and e["time"] > kill_time)
    if not back:
        raise ValueError(f"replica group {killed} committed nothing after the kill")
    lost = killed_group_steps_lost(steps, kill_time, killed) + sum(
        committed_steps_lost([e for e in steps if e["replica_group"] == g])
        for g in {e["replica_group"] for e in steps} - {killed})
    return {"survivors_s": surv["stall_s"], "rejoined_s": back[0] - kill_time, "lost": surv["discarded"] + lost,
            "committed_lost": float(lost)}


def plot(metrics: List[Metric], png_path: str) -> None:
    """Bars: time to resume (plain restart, ftbridge survivors, ftbridge rejoin) and steps lost."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = next(m for m in metrics if "plain_resume_s" in m.extra)
    x = m.extra
    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3.2))
    labels = ["plain DS\nrestart", "ftbridge\nsurvivors", "ftbridge\nrejoined"]
    values = [median(x["plain_resume_s"]), median(x["survivors_s"]), median(x["rejoined_s"])]
    colors = ["tab:gray", "tab:blue", "tab:cyan"]
    if x.get("survivors_fast_heartbeat_s"):
        labels.insert(2, "survivors,\n0.5 s heartbeat")
        values.insert(2, median(x["survivors_fast_heartbeat_s"]))
        colors.insert(2, "tab:purple")
    a.bar(labels, values, color=colors)
    a.tick_params(axis="x", labelsize=7)
    a.set_ylabel("seconds from SIGKILL")
    a.set_title("time until training resumes")
    b.bar(["plain DS", "ftbridge"], [median(x["plain_lost"]), median(x["ftbridge_lost"])],
          color=["tab:gray", "tab:blue"])
    b.set_ylabel("steps")
    b.set_title("steps of work lost")
    save_figure(fig, png_path)


@benchmark(NAME, plot=plot)
def run(settings: BenchSettings) -> List[Metric]:
    """Plain restart from a checkpoint against ftbridge, ``settings.reps`` each (1 in quick mode).

    Raises:
        TimeoutError / RuntimeError: a run failed or exceeded ``settings.timeout_s``.
        ValueError: a run's log lacks the records needed (see the helpers).
    """
    every = 4 if settings.quick else 10
    ft_runs = failure_jobs.ftbridge_kill_runs(settings)
    plain = []
    for i in range(len(ft_runs)):
        r = failure_jobs.plain_kill_run(os.path.join(settings.workdir, "plain_restart", f"rep{i}"), settings, every)
        plain.append(plain_resume([e for e in r.events if e["group_rank"] == 0], r.kill_time))
    ft = [ftbridge_resume(r.events, r.kill_time) for r in ft_runs]
    plain_s, surv_s, back_s = ([p["resume_s"] for p in plain], [f["survivors_s"] for f in ft],
                               [f["rejoined_s"] for f in ft])
    extra = {"plain_resume_s": plain_s, "survivors_s": surv_s, "rejoined_s": back_s, "checkpoint_every": every,
             "plain_lost": [p["lost"] for p in plain], "ftbridge_lost": [f["lost"] for f in ft]}
    fast = []
    if not settings.quick:
        # The survivors' stall is bounded by the lighthouse's heartbeat timeout: the same kill with a short one.
        fast_runs = failure_jobs.ftbridge_kill_runs(settings, failure_jobs.FAST_HEARTBEAT_TIMEOUT_MS)
        fast_ft = [ftbridge_resume(r.events, r.kill_time) for r in fast_runs]
        fast_s = [f["survivors_s"] for f in fast_ft]
        extra["survivors_fast_heartbeat_s"] = fast_s
        hb = failure_jobs.FAST_HEARTBEAT_TIMEOUT_MS / 1000
        fast = [
            ratio_metric(NAME, f"time to resume: plain restart / ftbridge survivors, heartbeat timeout {hb:g} s",
                         plain_s, fast_s, target_min=10, extra={"heartbeat_timeout_s": hb},
                         baseline_name=f"ftbridge survivors' first commit after the kill, "
                                       f"{hb:g} s heartbeat timeout (s)"),
            count_metric(f"ftbridge, heartbeat timeout {hb:g} s: steps lost (discarded + committed lost)",
                         [f["lost"] for f in fast_ft], 1, bench=NAME),
        ]
    hb = failure_jobs.HEARTBEAT_TIMEOUT_MS / 1000
    return [
        ratio_metric(NAME, f"time to resume: plain restart / ftbridge survivors, heartbeat timeout {hb:g} s",
                     plain_s, surv_s, target_min=10, extra=extra,
                     baseline_name=f"ftbridge survivors' first commit after the kill, {hb:g} s heartbeat timeout (s)"),
        *fast,
        ratio_metric(NAME, "time to resume, like for like: plain restart / ftbridge restarted group", plain_s,
                     back_s, target_min=1.0, baseline_name="ftbridge restarted group's first commit (s)"),
        Metric(NAME, "plain DeepSpeed: kill to first step after restart", median(plain_s), "s", plain_s),
        count_metric("plain DeepSpeed: steps lost (since the last checkpoint)", [p["lost"] for p in plain], None,
                     bench=NAME),
        count_metric("ftbridge: steps lost (discarded + committed lost)", [f["lost"] for f in ft], 1, bench=NAME,
                     baseline=median([p["lost"] for p in plain]), baseline_name="plain DeepSpeed steps lost"),
        count_metric("ftbridge: committed steps lost", [f["committed_lost"] for f in ft], 0, bench=NAME),
    ]
