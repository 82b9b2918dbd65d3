"""Heal: from a replica group's restart to its first committed step, by phase.

Uses the kill runs of :func:`~ftbridge.harness.bench.failure_jobs.ftbridge_kill_runs`
(group 1 SIGKILLed, restarted by torchrun, healed from group 0). The
restarted rank 0's event log gives the phase boundaries:

=================  =========================================================
phase              from .. to
=================  =========================================================
torchrun restart   SIGKILL .. the new process is created (``phase process_start``)
process start      .. imports done (``phase imports_done``, ``scripts/train_lm.py``)
DeepSpeed init     .. first step begins (data, model, ``deepspeed.initialize``, ftbridge manager)
quorum             .. heal fetch starts (lighthouse quorum, incl. steps discarded while waiting)
state transfer     .. heal state fetched and decoded (``heal_transfer`` event)
first commit       .. first committed step (load into DeepSpeed, the step itself)
=================  =========================================================

The phases tile the interval, so they sum to kill .. first commit.

Transfer throughput: heal bytes / (fetch start .. decoded), against a
loopback baseline measured in the same run: the same number of bytes sent
over a plain TCP socket on 127.0.0.1 between two threads of this process
(:func:`loopback_seconds`). Target: >= 50 % of the baseline.

In the job the transfer shares the 2 cores (and each process's GIL) with
training: the donor's forward runs beside its HTTP server thread, the
joiner's discarded step beside its fetch. So the suite also measures the
transport alone (:func:`transport_alone`): a donor process serving a state of
``TRANSPORT_MB`` (quick: ``TRANSPORT_MB_QUICK``) through
:class:`~ftbridge.manager.transport.SafeHTTPTransport`, fetched and decoded by this
process (into a receive buffer prepared beforehand, as a restarted rank's
is), against the loopback baseline for the same bytes; the donor's
``send_checkpoint`` time is reported on its own.

:data:`NAME_LARGE` (``heal_100m``) repeats the kill runs with a 100.9 M-parameter
model (:data:`LARGE_MODEL`; 1.2 GB of heal state per rank).
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Dict, List, Sequence

from ftbridge.harness.bench import failure_jobs
from ftbridge.harness.bench.core import BenchSettings, Metric, benchmark, median, ratio_metric, save_figure

NAME = "heal"
NAME_LARGE = "heal_100m"
LARGE_MODEL = ["--n-layer", "8", "--d-model", "1024", "--n-head", "16", "--context", "32", "--micro-batch", "1",
               "--warmup-steps", "2"]
"""Model flags of :data:`NAME_LARGE`: 100,937,728 parameters, a 1.2 GB heal state (fp32 weights and Adam's two
moments) per rank; short sequences keep a step near a second on 2 CPU cores."""
TRANSPORT_MB, TRANSPORT_MB_QUICK = 256, 16
"""State size of the transport-alone measurement (MB, fp32 tensors of 4 MB)."""
PHASES = ("torchrun restart", "process start", "DeepSpeed init", "quorum", "state transfer", "first commit")


def heal_phases(events: Sequence[Dict[str, Any]], kill_time: float) -> Dict[str, Any]:
    """Phase durations of one restarted rank's heal after a kill at ``kill_time``.

    Args:
        events: that rank's records (all launches), any order: ``phase``
            events, ``heal_transfer`` events and step records.
        kill_time: wall time of the SIGKILL (s since the epoch).

    Returns:
        ``phases`` (name -> seconds, in :data:`PHASES` order), ``total_s``
        (kill .. first commit), ``bytes`` and ``transfer_s`` of the heal fetch.

    Raises:
        ValueError: a boundary is missing (the job wrote no such record after
            the kill) or the boundaries are out of order.
    """
    ev = sorted(events, key=lambda e: e["time"])

    def first(what: str, pred: Any, after: float) -> Dict[str, Any]:
        found = next((e for e in ev if e["time"] >= after and pred(e)), None)
        if found is None:
            raise ValueError(f"no {what} after {after:.3f} in the restarted rank's event log")
        return found

    started = first("process_start phase", lambda e: e.get("event") == "phase" and e["name"] == "process_start",
                    kill_time)["time"]
    imported = first("imports_done phase", lambda e: e.get("event") == "phase" and e["name"] == "imports_done",
                     started)["time"]
    step = first("step record", lambda e: "event" not in e, imported)
    step_begin = step["time"] - step["step_time_s"]
    transfer = first("heal_transfer event", lambda e: e.get("event") == "heal_transfer", imported)
    commit = first("committed step", lambda e: "event" not in e and e["committed"], transfer["time"])["time"]
    bounds = [kill_time, started, imported, step_begin, transfer["start"], transfer["time"], commit]
    if any(b > a + 1e-6 for a, b in zip(bounds[1:], bounds)):
        raise ValueError(f"heal phase boundaries out of order: {bounds}")
    return {"phases": {n: bounds[i + 1] - bounds[i] for i, n in enumerate(PHASES)}, "total_s": commit - kill_time,
            "bytes": int(transfer["bytes"]), "transfer_s": transfer["time"] - transfer["start"]}


def loopback_seconds(nbytes: int, chunk: int = 1 << 20) -> float:
    """Seconds to send ``nbytes`` over a TCP socket on 127.0.0.1 between two threads (connect included).

    Raises:
        OSError: the loopback socket cannot be opened.
    """
    payload = memoryview(bytes(max(nbytes, 1)))
    server = socket.create_server(("127.0.0.1", 0))
    got = [0]

    def receive() -> None:
        conn, _ = server.accept()
        buf = bytearray(chunk)
        with conn:
            while got[0] < len(payload):
                n = conn.recv_into(buf)
                if not n:
                    break
                got[0] += n

    t = threading.Thread(target=receive, daemon=True)
    t.start()
    t0 = time.perf_counter()
    with socket.create_connection(server.getsockname(), timeout=60) as c:
        c.sendall(payload)
    t.join(timeout=60)
    elapsed = time.perf_counter() - t0
    server.close()
    if got[0] != len(payload):
        raise OSError(f"loopback baseline received {got[0]} of {len(payload)} bytes")
    return elapsed


def plot(metrics: List[Metric], png_path: str) -> None:
    """Stacked bar of the heal phases, one bar per repetition."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = next(m for m in metrics if "phases" in m.extra)
    reps = m.extra["phases"]
    fig, ax = plt.subplots(figsize=(6, 3.4))
    bottoms = [0.0] * len(reps)
    for name in PHASES:
        vals = [r[name] for r in reps]
        ax.bar(range(len(reps)), vals, 0.6, bottom=bottoms, label=name)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    ax.set_xticks(range(len(reps)), [f"rep {i + 1}" for i in range(len(reps))])
    ax.set_ylabel("seconds from SIGKILL")
    ax.set_title("Restarted replica group: kill to first committed step")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    save_figure(fig, png_path)


@benchmark(NAME, plot=plot)
def run(settings: BenchSettings) -> List[Metric]:
    """Heal phases and transfer throughput over the kill runs; see the module docstring.

    Raises:
        TimeoutError: a run stage exceeded ``settings.timeout_s``.
        ValueError: a restarted rank's log lacks a phase boundary.
    """
    out = kill_run_metrics(NAME, failure_jobs.ftbridge_kill_runs(settings))
    out += transport_alone(TRANSPORT_MB_QUICK if settings.quick else TRANSPORT_MB,
                           1 if settings.quick else settings.reps)
    return out


@benchmark(NAME_LARGE, plot=plot)
def run_large(settings: BenchSettings) -> List[Metric]:
    """The kill runs of :func:`run` with a model of :data:`LARGE_MODEL` (100.9 M parameters, 1.2 GB heal state).

    Not run with ``--quick`` (one more job of a minute in the CI smoke run,
    as for ``spare``); ``heal`` runs the same code path with the main model.

    Raises:
        TimeoutError: a run stage exceeded ``settings.timeout_s``.
        ValueError: a restarted rank's log lacks a phase boundary.
    """
    if settings.quick:
        return []
    return kill_run_metrics(NAME_LARGE, failure_jobs.ftbridge_kill_runs(settings, model=LARGE_MODEL,
                                                                        name="ftbridge_kill_100m"))


def kill_run_metrics(name: str, runs: Sequence[failure_jobs.KillRun]) -> List[Metric]:
    """Restart-to-commit total, phases, and in-job transfer throughput against loopback TCP, over ``runs``."""
    stats = [heal_phases([e for e in r.events if e["replica_group"] == 1 and e["group_rank"] == 0], r.kill_time)
             for r in runs]
    heal_rate = [s["bytes"] / s["transfer_s"] / 1e6 for s in stats]
    loop_rate = [s["bytes"] / loopback_seconds(s["bytes"]) / 1e6 for s in stats]
    totals = [s["total_s"] for s in stats]
    phases = [s["phases"] for s in stats]
    out = [Metric(name, "restart to first commit (kill .. first committed step)", median(totals), "s", totals,
                  extra={"phases": phases, "phase_medians_s": {p: median([x[p] for x in phases]) for p in PHASES}})]
    out += [Metric(name, f"phase: {p}", median([x[p] for x in phases]), "s", [x[p] for x in phases]) for p in PHASES]
    mbytes = median([s["bytes"] for s in stats]) / 1e6
    out.append(ratio_metric(name, f"heal transfer throughput / loopback TCP ({mbytes:.0f} MB)",
                            heal_rate, loop_rate,
                            baseline_name="plain TCP socket on 127.0.0.1, same bytes (MB/s)", target_min=0.5,
                            extra={"bytes": [s["bytes"] for s in stats],
                                   "transfer_s": [s["transfer_s"] for s in stats]}))
    return out


def _serve_state(mb: int, queue: Any, done: Any) -> None:
    """Donor process of :func:`transport_alone`: serve ``mb`` MB of fp32 tensors for step 0 until ``done``."""
    from datetime import timedelta

    import torch

    from ftbridge.manager.transport import SafeHTTPTransport

    n = 1 << 20  # 4 MB tensors
    state = {"optimizer": {str(i): torch.randn(n) for i in range(max(1, mb // 4))}, "step": 0}
    tx = SafeHTTPTransport("127.0.0.1", timedelta(seconds=60), max_recv_bytes=lambda: (mb + 8) << 20)
    t0 = time.perf_counter()
    tx.send_checkpoint([1], 0, state, timedelta(seconds=60))
    queue.put((tx.metadata(), time.perf_counter() - t0))
    done.wait(300)
    tx.shutdown()


def transport_alone(mb: int, reps: int) -> List[Metric]:
    """The heal transport between two idle processes: fetch + decode against loopback TCP, and ``send_checkpoint``.

    Args:
        mb: state size (MB); reps: fetches of the served state (each timed against its own loopback run).

    Raises:
        RuntimeError: the donor process did not start serving within 120 s.
    """
    import multiprocessing as mp
    import queue as queue_mod
    from datetime import timedelta

    from ftbridge.manager.transport import SafeHTTPTransport

    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    donor = ctx.Process(target=_serve_state, args=(mb, q, done), daemon=True)
    donor.start()
    try:
        try:
            address, encode_s = q.get(timeout=120)
        except queue_mod.Empty:
            raise RuntimeError(
                f"transport benchmark: the donor process (pid {donor.pid}) served nothing in 120 s") from None
        # A job's joiner bounds the body by its own state's size: this one by the state being served.
        joiner = SafeHTTPTransport("127.0.0.1", timedelta(seconds=60), max_recv_bytes=lambda: (mb + 8) << 20)
        rates, loop = [], []
        try:
            for _ in range(reps):
                joiner.prepare_recv(wait_s=60)  # as a restarted rank does while it starts up
                t0 = time.perf_counter()
                joiner.recv_checkpoint(0, address, 0, timedelta(seconds=60))
                seconds = time.perf_counter() - t0
                assert joiner.last_recv is not None  # set by every successful recv_checkpoint
                nbytes = joiner.last_recv["bytes"]
                rates.append(nbytes / seconds / 1e6)
                loop.append(nbytes / loopback_seconds(nbytes) / 1e6)
        finally:
            joiner.shutdown()
    finally:
        done.set()
        donor.join(timeout=30)
        if donor.is_alive():
            donor.kill()
    return [ratio_metric(NAME, f"transport alone, {mb} MB: fetch + decode throughput / loopback TCP", rates, loop,
                         baseline_name="plain TCP socket on 127.0.0.1, same bytes (MB/s)", target_min=0.5,
                         extra={"bytes": nbytes, "mb_per_s": rates}),
            Metric(NAME, f"transport alone, {mb} MB: donor send_checkpoint (lays the body out; no copy)",
                   nbytes / encode_s / 1e6, "MB/s", [nbytes / encode_s / 1e6])]
