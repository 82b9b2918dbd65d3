"""Lighthouse outage: what a 10 s outage costs the survivors, riding it out against waiting.

Two replica groups (1 rank each, ZeRO-2, the main job's model) train until they
commit together; then the lighthouse is unavailable for :data:`OUTAGE_S`
seconds, in one of three ways (:data:`KINDS`):

* ``dead``: stopped, and started again at the same address (connections refused);
* ``hung``: its process SIGSTOPped, then continued (it accepts connections and answers nothing);
* ``blackhole``: every group's link to a live lighthouse drops its packets
  (:class:`ftbridge.harness.netfault.FaultProxy`; connections still open).

Each repetition runs one job per kind with riding it out on
(``FTBRIDGE_RIDE_OUT_LIGHTHOUSE_OUTAGE=1``, the default), and the ``dead`` kind
once more with it off (every step waits for the lighthouse), in alternating
order. From each group's event log (:func:`ftbridge.harness.chaos.invariants.outage_pause`):

* **pause**: the longest time between two consecutive commits from the last
  commit before the outage until both groups commit together in a quorum from
  the lighthouse again (the way back counts);
* **steps lost**: ``pause / median step - 1`` (a pause of one ordinary step
  loses nothing); the worse of the two groups counts.

A run counts only if it ended identical across groups with exit 0.
Target: riding loses <= 1 step (median over repetitions), for every kind.

The same runs give the ride-through's cost when nothing fails: the
**step time** figure is the ratio, per repetition, of the median step time
before the outage with it on to that with it off (``dead`` runs), informative.

Not run with ``--quick``: its jobs would add minutes to the CI smoke run; the same paths run in
``tests/integration/test_protocol_faults.py``, ``test_lighthouse_outage.py`` and ``test_lighthouse_restart.py``.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Callable, Dict, List, Tuple

from ftbridge.harness.bench import failure_jobs
from ftbridge.harness.bench.core import BenchSettings, Metric, benchmark, median
from ftbridge.harness.chaos.invariants import outage_pause
from ftbridge.harness.local_job import LocalJob

NAME = "outage"
OUTAGE_S = 10.0
"""Length of the outage (seconds)."""
KINDS = ("dead", "hung", "blackhole")
"""Ways the lighthouse is unavailable (see the module docstring)."""


def _fault(job: LocalJob, kind: str) -> Tuple[Callable[[], None], Callable[[], None]]:
    """``(start, end)`` of an outage of ``kind`` on ``job``'s lighthouse."""
    if kind == "dead":
        return job.stop_lighthouse, job.start_lighthouse
    if kind == "hung":
        return (lambda: os.kill(job.lighthouse_pid, signal.SIGSTOP)), (lambda: os.kill(job.lighthouse_pid,
                                                                                          signal.SIGCONT))

    def every(mode: str) -> None:
        for g in (0, 1):
            job.proxy(g).set(mode)

    return (lambda: every("blackhole")), (lambda: every("pass"))


def outage_run(workdir: str, settings: BenchSettings, ride: bool, kind: str = "dead") -> Dict[str, float]:
    """One job with one lighthouse outage of ``kind``; the worse survivor's pause, steps lost and commits during it.

    Raises:
        TimeoutError: any wait past ``settings.timeout_s``.
        RuntimeError: the run did not end identical across groups with exit 0.
        ValueError: a group has no commit before or after the outage, or an unknown ``kind``.
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not one of {KINDS}")
    t_out, outage_s = settings.timeout_s, OUTAGE_S
    args = [*failure_jobs.model_args(settings), "--steps", "1000000", "--stop-file", os.path.join(workdir, "stop")]
    job = LocalJob(workdir, 2, 1, args, max_restarts=0, checksum_every=None, lighthouse_process=kind == "hung",
                   proxies=kind == "blackhole",
                   env={"OMP_NUM_THREADS": "1", "FTBRIDGE_RIDE_OUT_LIGHTHOUSE_OUTAGE": "1" if ride else "0"})
    warm = failure_jobs.warm_steps(settings)
    with job:
        job.start()
        job.wait_until(lambda: all(any(e["committed"] and e["participants"] == 2 and e["step"] >= warm
                                       for e in job.steps(g)) for g in (0, 1)), t_out, "both groups to commit together")
        start, end = _fault(job, kind)
        t_down = time.time()
        start()
        time.sleep(outage_s)  # the failure itself: no lighthouse for this long
        end()
        t_up = time.time()
        # Together again in a quorum from the lighthouse (a riding commit after t_up does not count: a group
        # stopped then could leave the other to go on alone).
        job.wait_until(lambda: all(any(e["committed"] and e["participants"] == 2 and e["time"] > t_up
                                       and not e.get("rode_out_outage") for e in job.steps(g)) for g in (0, 1)),
                       t_out, "both groups to commit together in a new quorum")
        settle_s = time.time() - t_up  # the way back to the lighthouse counts too
        job.stop_soon()
        codes = job.wait(t_out)
        events = job.events()
    failure_jobs.check_recovered(events, codes, groups=(0, 1), ranks=1, what=f"outage run in {workdir}")
    pauses = []
    for g in (0, 1):
        p = outage_pause([e for e in events if "event" not in e and e["replica_group"] == g], t_down, t_up,
                         settle_s)
        if p is None:
            raise ValueError(f"group {g} has no commit before or after the outage in {workdir}")
        pauses.append(p)
    worst = max(pauses, key=lambda p: p.steps_lost)
    return {"pause_s": worst.pause_s, "steps_lost": worst.steps_lost, "step_s": worst.step_s,
            "committed": float(min(p.committed for p in pauses)), "reference_s": worst.reference_s or 0.0}


@benchmark(NAME)
def run(settings: BenchSettings) -> List[Metric]:
    """Steps lost to a lighthouse outage of each kind riding it out, and to a dead one waiting; see the module
    docstring.

    Raises:
        TimeoutError, RuntimeError, ValueError: see :func:`outage_run`.
    """
    if settings.quick:
        return []
    runs: Dict[str, List[Dict[str, float]]] = {k: [] for k in (*KINDS, "wait")}
    for i in range(settings.reps):
        order = [(k, True) for k in KINDS] + [("dead", False)]
        for kind, ride in (order if i % 2 == 0 else order[::-1]):  # alternate: a drifting machine cancels
            name = f"{kind if ride else 'wait'}{i}"
            runs[kind if ride else "wait"].append(outage_run(os.path.join(settings.workdir, NAME, name), settings,
                                                             ride, kind))
    wait = runs["wait"]
    lost_wait = [r["steps_lost"] for r in wait]
    out = []
    for kind in KINDS:
        on = runs[kind]
        lost = [r["steps_lost"] for r in on]
        extra = {k: {"ride": [r[k] for r in on], "wait": [r[k] for r in wait]}
                 for k in ("pause_s", "step_s", "committed", "reference_s", "steps_lost")}
        out += [
            Metric(NAME, f"steps lost to a {kind} lighthouse, riding it out", median(lost), "steps", lost,
                   median(lost_wait), "waiting for a dead lighthouse (FTBRIDGE_RIDE_OUT_LIGHTHOUSE_OUTAGE=0)", "<= 1",
                   median(lost) <= 1.0, extra),
            Metric(NAME, f"longest pause between commits, {kind} lighthouse, riding it out",
                   median(extra["pause_s"]["ride"]), "s", extra["pause_s"]["ride"], median(extra["pause_s"]["wait"]),
                   "waiting for a dead lighthouse"),
            Metric(NAME, f"commits during the outage, {kind} lighthouse, riding it out",
                   median(extra["committed"]["ride"]), "steps", extra["committed"]["ride"],
                   median(extra["committed"]["wait"]), "waiting for a dead lighthouse"),
        ]
    cost = [a["step_s"] / b["step_s"] for a, b in zip(runs["dead"], wait) if b["step_s"] > 0]
    out.append(Metric(NAME, "step time before the outage, ride-through on / off", median(cost), "ratio", cost,
                      None, "ride-through off, same repetition"))
    return out
