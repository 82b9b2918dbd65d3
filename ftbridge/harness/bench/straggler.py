"""A straggler: the job's step rate while one replica group runs at half speed.

Two replica groups (1 rank each, ZeRO-2, the main job's model) train until they
commit together. Then, in one job, three windows of :data:`WINDOW_S` seconds:

* **clean**, **slow**, **clean**: during the slow window group 1's ranks are
  stopped (SIGSTOP) for the first half of every :data:`ftbridge.harness.chaos.inject.SLOW_PERIOD_S`
  period and continued for the second half (:func:`ftbridge.harness.chaos.inject.half_speed`, as
  ``ftbridge-chaos``'s ``slow_group``);
  a group that is slow, not dead.

Measured on group 0 (the healthy group), whose rate is the job's: its commits per second in the slow window
against the mean of the two clean windows around it (the baseline, in the same job, so a drifting machine
cancels). Also: the share of group 0's commits in the slow window that group 1 took part in
(``participants == 2``): whether the job waited for the straggler or went on without it.

Informative, no target: ftbridge does not yet leave a slow but live group out on purpose; its all-reduce
waits for it up to the cross-replica timeout. Not run with ``--quick``.

A run counts only if it ended identical across groups with exit 0.
"""

from __future__ import annotations

import os
import time
from typing import Any, Dict, List, Sequence

from ftbridge.harness.bench import failure_jobs
from ftbridge.harness.bench.core import BenchSettings, Metric, benchmark, median
from ftbridge.harness.chaos.inject import half_speed
from ftbridge.harness.local_job import LocalJob

NAME = "straggler"
WINDOW_S = 10.0
"""Length of each window (seconds)."""


def window_rate(steps: Sequence[Dict[str, Any]], t0: float, t1: float) -> Dict[str, float]:
    """Commits per second of one group's step records in ``[t0, t1)`` (pure), and the share of them with every
    group taking part (``participants`` equal to the most seen in the records).

    Args:
        steps: step records of one rank (``time`` in seconds since the epoch, ``committed``, ``participants``).
        t0, t1: the window, ``t0 < t1``.

    Raises:
        ValueError: ``t1 <= t0``.
    """
    if not t1 > t0:
        raise ValueError(f"window [{t0}, {t1}) is empty: t1 must be after t0")
    full = max((int(e["participants"]) for e in steps), default=0)
    inside = [e for e in steps if e["committed"] and t0 <= e["time"] < t1]
    together = sum(int(e["participants"]) == full for e in inside)
    return {"rate": len(inside) / (t1 - t0), "together": together / len(inside) if inside else 0.0}


def straggler_run(workdir: str, settings: BenchSettings, window_s: float = WINDOW_S) -> Dict[str, float]:
    """One job: clean, slow (group 1 at half speed) and clean windows; group 0's rates in them.

    Raises:
        TimeoutError: any wait past ``settings.timeout_s``.
        RuntimeError: the run did not end identical across groups with exit 0.
    """
    t_out = settings.timeout_s
    args = [*failure_jobs.model_args(settings), "--steps", "1000000", "--stop-file", os.path.join(workdir, "stop")]
    job = LocalJob(workdir, 2, 1, args, max_restarts=0, checksum_every=None, env={"OMP_NUM_THREADS": "1"})
    warm = failure_jobs.warm_steps(settings)
    with job:
        job.start()
        job.wait_until(lambda: all(any(e["committed"] and e["participants"] == 2 and e["step"] >= warm
                                       for e in job.steps(g)) for g in (0, 1)), t_out, "both groups to commit together")
        marks = [time.time()]
        time.sleep(window_s)  # the clean window itself
        marks.append(time.time())
        half_speed(sorted(job.worker_pids(1).values()), window_s)  # the slow window
        marks.append(time.time())
        time.sleep(window_s)  # the second clean window
        marks.append(time.time())
        job.stop_soon()
        codes = job.wait(t_out)
        events = job.events()
    failure_jobs.check_recovered(events, codes, groups=(0, 1), ranks=1, what=f"straggler run in {workdir}")
    steps = [e for e in events if "event" not in e and e["replica_group"] == 0]
    before, slow, after = (window_rate(steps, a, b) for a, b in zip(marks, marks[1:]))
    clean = (before["rate"] + after["rate"]) / 2
    return {"clean_rate": clean, "slow_rate": slow["rate"], "ratio": slow["rate"] / clean if clean else 0.0,
            "together_slow": slow["together"], "together_clean": (before["together"] + after["together"]) / 2}


@benchmark(NAME)
def run(settings: BenchSettings) -> List[Metric]:
    """The job's step rate with one of two groups at half speed, against the same job's clean windows; see the
    module docstring.

    Raises:
        TimeoutError, RuntimeError: see :func:`straggler_run`.
    """
    if settings.quick:
        return []
    runs = [straggler_run(os.path.join(settings.workdir, NAME, f"run{i}"), settings) for i in range(settings.reps)]
    ratio = [r["ratio"] for r in runs]
    slow, clean = [r["slow_rate"] for r in runs], [r["clean_rate"] for r in runs]
    together = [r["together_slow"] for r in runs]
    return [
        Metric(NAME, "job step rate, one of 2 groups at half speed / no straggler", median(ratio), "ratio", ratio,
               None, "clean windows before and after, same job", extra={"slow_rate": slow, "clean_rate": clean}),
        Metric(NAME, "step rate with a straggler", median(slow), "steps/s", slow, median(clean),
               "no straggler, same job"),
        Metric(NAME, "commits the straggler took part in, while slow", median(together), "share", together,
               median([r["together_clean"] for r in runs]), "while not slow"),
    ]
