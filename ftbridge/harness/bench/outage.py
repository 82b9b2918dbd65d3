"""Lighthouse outage: what a 10 s outage costs the survivors, riding it out against waiting (issue #15 item 2).

Two replica groups (1 rank each, ZeRO-2, the main job's model) train until they
commit together; the lighthouse is stopped for :data:`OUTAGE_S` seconds and
started again at the same address. Each repetition runs the job twice, in
alternating order: with :mod:`ftbridge.manager.outage` (``FTBRIDGE_RIDE_OUT_LIGHTHOUSE_OUTAGE=1``,
the default) and without it (every step waits for the lighthouse). From each
group's event log (:func:`ftbridge.harness.chaos.invariants.outage_pause`):

* **pause**: the longest time between two consecutive commits from the last
  commit before the outage to the first commit after it;
* **steps lost**: ``pause / median step - 1`` (a pause of one ordinary step
  loses nothing); the worse of the two groups counts.

A run counts only if it ended identical across groups with exit 0.
Target: riding loses <= 1 step (median over repetitions).

The same runs give the ride-through's cost when nothing fails: with it on, every
step ends with the outage agreement (one more cross-replica all-reduce of
``21 x groups`` float64). The **step time** figure is the ratio, per repetition,
of the median step time before the outage with it on to that with it off
(the two runs of one repetition), informative.

Not run with ``--quick``: its two jobs would add about a minute to the CI smoke run, and the same path
runs in ``tests/integration/test_lighthouse_outage.py`` and ``test_lighthouse_restart.py``.
"""

from __future__ import annotations

import os
import time
from typing import Dict, List

from ftbridge.harness.bench import failure_jobs
from ftbridge.harness.bench.core import BenchSettings, Metric, benchmark, median
from ftbridge.harness.chaos.invariants import outage_pause
from ftbridge.harness.local_job import LocalJob

NAME = "outage"
OUTAGE_S = 10.0
"""Length of the outage (seconds)."""


def outage_run(workdir: str, settings: BenchSettings, ride: bool) -> Dict[str, float]:
    """One job with one lighthouse outage; the worse survivor's pause, steps lost and commits during it.

    Raises:
        TimeoutError: any wait past ``settings.timeout_s``.
        RuntimeError: the run did not end identical across groups with exit 0.
        ValueError: a group has no commit before or after the outage.
    """
    t_out, outage_s = settings.timeout_s, OUTAGE_S
    args = [*failure_jobs.model_args(settings), "--steps", "1000000", "--stop-file", os.path.join(workdir, "stop")]
    job = LocalJob(workdir, 2, 1, args, max_restarts=0, checksum_every=None,
                   env={"OMP_NUM_THREADS": "1", "FTBRIDGE_RIDE_OUT_LIGHTHOUSE_OUTAGE": "1" if ride else "0"})
    warm = failure_jobs.warm_steps(settings)
    with job:
        job.start()
        job.wait_until(lambda: all(any(e["committed"] and e["participants"] == 2 and e["step"] >= warm
                                       for e in job.steps(g)) for g in (0, 1)), t_out, "both groups to commit together")
        t_down = time.time()
        job.stop_lighthouse()
        time.sleep(outage_s)  # the failure itself: no lighthouse for this long
        job.start_lighthouse()
        t_up = time.time()
        # Together again in a quorum from the lighthouse (a riding commit after t_up does not count: a group
        # stopped then could leave the other to go on alone).
        job.wait_until(lambda: all(any(e["committed"] and e["participants"] == 2 and e["time"] > t_up
                                       and not e.get("rode_out_outage") for e in job.steps(g)) for g in (0, 1)),
                       t_out, "both groups to commit together in a new quorum")
        job.write_file("stop", str(job.max_step() + 2))
        codes = job.wait(t_out)
        events = job.events()
    failure_jobs.check_recovered(events, codes, groups=(0, 1), ranks=1, what=f"outage run in {workdir}")
    pauses = []
    for g in (0, 1):
        p = outage_pause([e for e in events if "event" not in e and e["replica_group"] == g], t_down, t_up)
        if p is None:
            raise ValueError(f"group {g} has no commit before or after the outage in {workdir}")
        pauses.append(p)
    worst = max(pauses, key=lambda p: p.steps_lost)
    return {"pause_s": worst.pause_s, "steps_lost": worst.steps_lost, "step_s": worst.step_s,
            "committed": float(min(p.committed for p in pauses)), "reference_s": worst.reference_s or 0.0}


@benchmark(NAME)
def run(settings: BenchSettings) -> List[Metric]:
    """Steps lost to a lighthouse outage with and without riding it out; see the module docstring.

    Raises:
        TimeoutError, RuntimeError, ValueError: see :func:`outage_run`.
    """
    if settings.quick:
        return []
    reps = settings.reps
    runs: Dict[bool, List[Dict[str, float]]] = {True: [], False: []}
    for i in range(reps):
        for ride in ((True, False) if i % 2 == 0 else (False, True)):  # alternate: a drifting machine cancels
            runs[ride].append(outage_run(os.path.join(settings.workdir, NAME, f"{'ride' if ride else 'wait'}{i}"),
                                         settings, ride))
    on, off = runs[True], runs[False]
    lost_on, lost_off = [r["steps_lost"] for r in on], [r["steps_lost"] for r in off]
    extra = {k: {"ride": [r[k] for r in on], "wait": [r[k] for r in off]}
             for k in ("pause_s", "step_s", "committed", "reference_s")}
    extra["steps_lost"] = {"ride": lost_on, "wait": lost_off}
    cost = [a["step_s"] / b["step_s"] for a, b in zip(on, off) if b["step_s"] > 0]
    return [
        Metric(NAME, "steps lost to the outage, riding it out", median(lost_on), "steps", lost_on, median(lost_off),
               "steps lost waiting for the lighthouse (FTBRIDGE_RIDE_OUT_LIGHTHOUSE_OUTAGE=0)", "<= 1",
               median(lost_on) <= 1.0, extra),
        Metric(NAME, "longest pause between commits, riding it out", median(extra["pause_s"]["ride"]), "s",
               extra["pause_s"]["ride"], median(extra["pause_s"]["wait"]), "waiting for the lighthouse"),
        Metric(NAME, "commits during the outage, riding it out", median(extra["committed"]["ride"]), "steps",
               extra["committed"]["ride"], median(extra["committed"]["wait"]), "waiting for the lighthouse"),
        Metric(NAME, "step time before the outage, ride-through on / off (the agreement in every step)",
               median(cost), "ratio", cost, None, "ride-through off, same repetition"),
    ]
