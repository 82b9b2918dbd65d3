"""Jobs with a failure in them, shared by the failover, heal, restart and rescale benchmarks.

Private to :mod:`ftbridge.harness.bench`; the lead may merge it with the general job
helpers of :mod:`ftbridge.harness.bench.jobs`.

* :func:`ftbridge_kill_runs`: an ftbridge job of 2 replica groups; once both
  commit together, every rank of group 1 is SIGKILLed; the survivors go on,
  torchrun restarts group 1, which heals. One such run feeds three
  benchmarks (failover: the survivors' stall; heal: the restarted group's
  phases; restart: ftbridge's side), so the runs of one suite invocation are
  cached per ``(workdir, settings)``.
* :func:`ftbridge_hang_runs`: the same job, but group 1 is SIGSTOPped (hung)
  instead of killed, with the peer watch on or off (``FTBRIDGE_PEER_WATCH``);
  after the survivors commit alone it gets SIGCONT and rejoins by healing.
* :func:`plain_kill_run`: the same failure in plain DeepSpeed under torchrun
  ``--max-restarts 1`` (c10d rendezvous, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``),
  saving a DeepSpeed checkpoint every N steps and loading the latest on start.
* :func:`torchrun`: run a worker script under torchrun with a timeout.

A recovery run counts only if it ended well: every launcher exited 0 and every
rank of every group ended at the same step with the same parameters (and the
same optimizer state per group rank), from the ranks' ``final`` records
(:func:`check_recovered`); the plain run's torchrun must exit 0. Otherwise the
run raises and the benchmarks built on it fail, whatever their times.

Every process is started in its own session and ended by PID.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Sequence, Tuple

from ftbridge.events import read_events
from ftbridge.harness.bench.core import BenchSettings
from ftbridge.harness.local_job import TRAIN_SCRIPT, LocalJob
from ftbridge.launch.processes import pid_alive, signal_pids, stop_process_groups, torchrun_command

log = logging.getLogger("ftbridge.harness.bench")

HEARTBEAT_TIMEOUT_MS = 2000
"""Lighthouse heartbeat timeout of the kill runs (LocalJob's default), the same in quick and full mode."""
FAST_HEARTBEAT_TIMEOUT_MS = 500
"""A short heartbeat timeout (5 heartbeats of 100 ms) for the restart benchmark's second ftbridge
configuration (full mode): the survivors' stall is bounded by this timeout."""
RANKS_PER_GROUP = 1
"""Ranks per replica group in the kill runs: 2 groups x 1 rank = the machine's 2 cores."""
QUICK_MODEL = ["--n-layer", "2", "--d-model", "64", "--n-head", "4", "--context", "32", "--micro-batch", "4",
               "--warmup-steps", "2"]
"""Model flags in quick mode (the tests' tiny model); the full run uses the main job's model (832,512 parameters)."""


def model_args(settings: BenchSettings) -> List[str]:
    """Training-job flags for the model of this run (tiny in quick mode), without validation."""
    return [*(QUICK_MODEL if settings.quick else []), "--val-every", "0", "--val-batches", "1"]


def warm_steps(settings: BenchSettings) -> int:
    """Committed steps before the failure is injected (fewer in quick mode)."""
    return 3 if settings.quick else max(5, settings.warmup_steps)


@dataclass
class KillRun:
    """One run with a failure: when it was injected and every event record of the job."""

    kill_time: float
    """Wall time (seconds since the epoch) just before the SIGKILL."""
    events: List[Dict[str, Any]]
    """All records of all ranks, sorted by time."""
    heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_MS / 1000
    extra: Dict[str, Any] = field(default_factory=dict)


_CACHE: Dict[Tuple, List[KillRun]] = {}


def ftbridge_kill_runs(settings: BenchSettings, heartbeat_timeout_ms: int = HEARTBEAT_TIMEOUT_MS,
                       model: Sequence[str] = (), name: str = "") -> List[KillRun]:
    """``settings.reps`` ftbridge kill runs (1 in quick mode), cached for this suite invocation.

    Args:
        heartbeat_timeout_ms: the lighthouse's heartbeat timeout (ms).
        model: training-job flags that replace the model of this run (e.g.
            the heal benchmark's 100 M-parameter variant); ``name``: its work folder.

    Raises:
        TimeoutError: a stage took longer than ``settings.timeout_s`` (group log tails included).
        RuntimeError: a run did not end identical across groups with exit 0 (:func:`check_recovered`).
    """
    key = (os.path.abspath(settings.workdir), settings.quick, settings.reps, settings.warmup_steps,
           heartbeat_timeout_ms, tuple(model))
    if key not in _CACHE:
        reps = 1 if settings.quick else settings.reps
        name = name or ("ftbridge_kill" if heartbeat_timeout_ms == HEARTBEAT_TIMEOUT_MS
                        else f"ftbridge_kill_hb{heartbeat_timeout_ms}")
        _CACHE[key] = [ftbridge_kill_run(os.path.join(settings.workdir, name, f"rep{i}"), settings,
                                         heartbeat_timeout_ms, model) for i in range(reps)]
    return _CACHE[key]


def ftbridge_kill_run(workdir: str, settings: BenchSettings,
                      heartbeat_timeout_ms: int = HEARTBEAT_TIMEOUT_MS, model: Sequence[str] = ()) -> KillRun:
    """2 groups train; group 1 is SIGKILLed, restarts (torchrun), heals and commits twice; then all stop.

    Raises:
        TimeoutError: any wait past ``settings.timeout_s``.
        RuntimeError: the run did not end identical across groups with exit 0 (:func:`check_recovered`).
    """
    t_out = settings.timeout_s
    args = [*model_args(settings), *model, "--steps", "1000000", "--stop-file", os.path.join(workdir, "stop")]
    job = LocalJob(workdir, 2, RANKS_PER_GROUP, args, max_restarts=1, heartbeat_timeout_ms=heartbeat_timeout_ms,
                   env={"OMP_NUM_THREADS": "1"}, checksum_every=None)
    warm = warm_steps(settings)
    with job:
        job.start()
        kill_time = kill_group_1_and_heal(job, warm, t_out)
        codes = job.wait(t_out)
        events = job.events()
        check_recovered(events, codes, groups=(0, 1), ranks=RANKS_PER_GROUP, what=f"kill run in {workdir}")
        return KillRun(kill_time, events, heartbeat_timeout_ms / 1000, extra={"exit_codes": codes})


def ftbridge_hang_runs(settings: BenchSettings, peer_watch: bool) -> List[KillRun]:
    """``settings.reps`` hang runs (:func:`ftbridge_hang_run`), cached for this suite invocation."""
    key = (os.path.abspath(settings.workdir), settings.quick, settings.reps, settings.warmup_steps, "hang", peer_watch)
    if key not in _CACHE:
        reps = 1 if settings.quick else settings.reps
        name = f"ftbridge_hang_watch_{'on' if peer_watch else 'off'}"
        _CACHE[key] = [ftbridge_hang_run(os.path.join(settings.workdir, name, f"rep{i}"), settings, peer_watch)
                       for i in range(reps)]
    return _CACHE[key]


def ftbridge_hang_run(workdir: str, settings: BenchSettings, peer_watch: bool,
                      alone_steps: int = 3) -> KillRun:
    """2 groups train; every rank of group 1 is SIGSTOPped until group 0 commits ``alone_steps`` steps alone
    (or ``settings.timeout_s`` passes), then SIGCONTed; it rejoins by healing; then all stop.

    ``kill_time`` is the time of the SIGSTOP. No torchrun restart is allowed: a hung group must come back
    by healing, not by restarting.

    Raises:
        TimeoutError: any wait past ``settings.timeout_s``.
        RuntimeError: the run did not end identical across groups with exit 0 (:func:`check_recovered`).
    """
    t_out = settings.timeout_s
    args = [*model_args(settings), "--steps", "1000000", "--stop-file", os.path.join(workdir, "stop")]
    job = LocalJob(workdir, 2, RANKS_PER_GROUP, args, max_restarts=0, heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS,
                   env={"OMP_NUM_THREADS": "1", "FTBRIDGE_PEER_WATCH": "1" if peer_watch else "0"},
                   checksum_every=None)
    warm = warm_steps(settings)
    with job:
        job.start()
        job.wait_until(lambda: all(any(e["committed"] and e["participants"] == 2 and e["step"] >= warm
                                       for e in job.steps(g)) for g in (0, 1)), t_out, "both groups to commit together")
        pids = list(job.worker_pids(1).values())
        stop_time = time.time()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            job.wait_until(lambda: sum(e["committed"] and e["participants"] == 1 and e["time"] > stop_time
                                       for e in job.steps(0)) >= alone_steps, t_out, "group 0 to commit alone")
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        cont_time = time.time()
        job.wait_heal(1, cont_time, t_out, "the hung group 1 to heal")
        job.wait_step(1, job.max_step() + 2, t_out, since=cont_time)
        job.stop_soon()
        codes = job.wait(t_out)
        events = job.events()
        check_recovered(events, codes, groups=(0, 1), ranks=RANKS_PER_GROUP, what=f"hang run in {workdir}")
        return KillRun(stop_time, events, HEARTBEAT_TIMEOUT_MS / 1000,
                       extra={"exit_codes": codes, "peer_watch": peer_watch, "hang_s": cont_time - stop_time})


def check_recovered(events: Sequence[Dict[str, Any]], codes: Dict[int, Any], groups: Sequence[int], ranks: int,
                    what: str) -> None:
    """Raise unless the run ended well: exit 0 everywhere, every group identical at the same step.

    Args:
        events: every record of the job (``final`` events carry ``step``,
            ``param_checksum`` and ``optimizer_checksum``; a rank's last launch counts).
        codes: replica group -> its launcher's exit status.
        groups: the groups that must end; ranks: ranks per group.
        what: names the run in the error.

    Raises:
        RuntimeError: a non-zero (or missing) exit status, a rank without a
            final record, different final steps, parameters or optimizer state.
    """
    problems = [f"replica group {g} exited {codes.get(g)!r}" for g in groups if codes.get(g) != 0]
    last: Dict[Tuple[int, int], Dict[str, Any]] = {}
    for e in sorted((e for e in events if e.get("event") == "final"), key=lambda e: e["time"]):
        last[(e["replica_group"], e["group_rank"])] = e
    missing = [(g, r) for g in groups for r in range(ranks) if (g, r) not in last]
    if missing:
        problems.append(f"no final record from (group, rank) {missing}")
    finals = [last[(g, r)] for g in groups for r in range(ranks) if (g, r) in last]
    for key, label in (("step", "steps"), ("param_checksum", "parameters")):
        values = {(f["replica_group"], f["group_rank"]): f.get(key) for f in finals}
        if len(set(values.values())) > 1 or None in values.values():
            problems.append(f"final {label} differ: {values}")
    for r in range(ranks):
        opt = {f["replica_group"]: f.get("optimizer_checksum") for f in finals if f["group_rank"] == r}
        if len(set(opt.values())) > 1 or None in opt.values():
            problems.append(f"group rank {r}: final optimizer state differs across groups: {opt}")
    if problems:
        raise RuntimeError(f"{what} did not end identical with exit 0: " + "; ".join(problems))


def plain_kill_run(workdir: str, settings: BenchSettings, every: int, nproc: int = 2) -> KillRun:
    """Plain DeepSpeed on ``nproc`` ranks under torchrun; SIGKILL rank 0 mid-way between checkpoints.

    Saves every ``every`` steps; the kill lands after a step ``s`` with
    ``s % every == every // 2`` and ``s > every`` is recorded (so a checkpoint
    exists), never inside a save (:func:`_kill_between_saves`); the restarted
    ranks load the latest checkpoint and the run stops two steps after the
    first step of the restart.

    Raises:
        TimeoutError: a stage took longer than ``settings.timeout_s`` (log tail included).
        RuntimeError: torchrun exited before the scenario played out, or not with 0 at the end.
    """
    os.makedirs(workdir, exist_ok=True)
    log_path = os.path.join(workdir, "plain.log")
    job_args = ["--plain", *model_args(settings), "--steps", "1000000", "--stop-file", os.path.join(workdir, "stop"),
                "--event-log", os.path.join(workdir, "events_0_{group_rank}.jsonl"),
                "--checkpoint-dir", os.path.join(workdir, "ckpt"), "--checkpoint-every", str(every), "--resume"]
    environ = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn", "PYTHONUNBUFFERED": "1"}
    cmd, env = torchrun_command(TRAIN_SCRIPT, job_args, nproc_per_node=nproc, max_restarts=1, environ=environ)
    paths = [os.path.join(workdir, f"events_0_{r}.jsonl") for r in range(nproc)]
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        def steps() -> List[Dict[str, Any]]:
            return [e for e in read_events(paths[:1]) if "event" not in e]

        def rank0_pid() -> int:
            return next(e["pid"] for e in read_events(paths[:1]) if e.get("event") == "start")
        kill_time, killed = _kill_between_saves(proc, steps, rank0_pid, every, settings.timeout_s, log_path)
        _wait(lambda: any(e["time"] > kill_time for e in steps()), proc, settings.timeout_s,
              "the restarted plain run to step", log_path)
        last = max(e["step"] for e in steps())
        with open(os.path.join(workdir, "stop"), "w", encoding="utf-8") as f:
            f.write(str(last + 2))
        proc.wait(timeout=settings.timeout_s)
        if proc.returncode != 0:
            with open(log_path, encoding="utf-8", errors="replace") as f:
                tail = "".join(f.readlines()[-30:])
            raise RuntimeError(f"the restarted plain run exited {proc.returncode} (log {log_path}):\n{tail}")
        return KillRun(kill_time, read_events(paths), extra={"exit_code": proc.returncode, "killed_pid": killed})
    finally:
        stop_process_groups([proc], grace_s=15)
        signal_pids([e["pid"] for e in read_events(paths) if e.get("event") == "start" and pid_alive(e["pid"])],
                    signal.SIGKILL)


def _kill_between_saves(proc: subprocess.Popen, steps: Callable[[], List[Dict[str, Any]]], rank0_pid: Callable[[], int],
                        every: int, timeout_s: float, log_path: str) -> Tuple[float, int]:
    """SIGKILL the plain run's rank 0 mid-way between two checkpoints; returns (kill time in s since the epoch, pid).

    Waits for a step ``s > every`` with ``s % every == every // 2`` in rank 0's
    records (``steps``), then stops rank 0 (SIGSTOP) and reads its last
    recorded step: a rank writes a step's record before that step's
    ``save_checkpoint``, so a last step that is not a multiple of ``every``
    means rank 0 is not saving, and the kill lands. Otherwise (a tiny model
    runs several steps in one poll) rank 0 goes on (SIGCONT) and the next
    window is awaited. Killed inside a save, plain DeepSpeed may leave
    ``latest`` naming a checkpoint whose files the other rank never finished
    (rank 0 writes ``latest`` without waiting for them), and the restart
    fails: not the scenario measured.

    Raises:
        TimeoutError / RuntimeError: as ``_wait``.
    """
    deadline = time.monotonic() + timeout_s
    seen = every  # windows at or before this step are past
    while True:
        def window() -> bool:
            return any(e["step"] > seen and e["step"] % every == every // 2 for e in steps())
        _wait(window, proc, max(1.0, deadline - time.monotonic()), "the plain run to reach the kill step", log_path)
        pid = rank0_pid()
        os.kill(pid, signal.SIGSTOP)
        last = max(e["step"] for e in steps())
        if last % every != 0:
            kill_time = time.time()
            os.kill(pid, signal.SIGKILL)
            return kill_time, pid
        log.info("plain run: rank 0 reached the save of step %d before the kill; waiting for the next window", last)
        os.kill(pid, signal.SIGCONT)
        seen = last


def torchrun(nproc: int, script: str, argv: Sequence[str], timeout_s: float) -> float:
    """Run ``script argv`` on ``nproc`` ranks (c10d rendezvous); returns its wall time (s).

    Raises:
        RuntimeError: a non-zero exit (output tail included).
        subprocess.TimeoutExpired: still running after ``timeout_s`` (the process group is killed).
    """
    cmd, env = torchrun_command(script, argv, nproc_per_node=nproc,
                                environ={**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"})
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    finally:
        stop_process_groups([proc], grace_s=15)
    if proc.returncode != 0:
        raise RuntimeError(f"{os.path.basename(script)} {' '.join(argv)} failed ({proc.returncode}):\n{out[-3000:]}")
    return time.perf_counter() - t


def _wait(cond: Any, proc: subprocess.Popen, timeout_s: float, what: str, log_path: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if proc.poll() is not None or time.monotonic() > deadline:
            with open(log_path, encoding="utf-8", errors="replace") as f:
                tail = "".join(f.readlines()[-30:])
            how = (f"torchrun exited ({proc.returncode})" if proc.poll() is not None
                   else f"timed out after {timeout_s} s")
            raise (RuntimeError if proc.poll() is not None else TimeoutError)(f"{how} waiting for {what}\n{tail}")
        time.sleep(0.05)


def kill_group_1_and_heal(job: Any, warm: int, t_out: float) -> float:
    """Once both groups committed step ``warm`` together, SIGKILL group 1, wait for it to heal and train on,
    then ask the job to stop after one more step. Returns the kill time (s since the epoch).

    Raises:
        TimeoutError: a wait exceeded ``t_out`` seconds.
    """
    job.wait_until(lambda: all(any(e["committed"] and e["participants"] == 2 and e["step"] >= warm
                                   for e in job.steps(g)) for g in (0, 1)), t_out, "both groups to commit together")
    kill_time = time.time()
    job.kill_workers(1)
    job.wait_heal(1, kill_time, t_out, "restarted group 1 to heal")
    job.wait_step(1, job.max_step() + 2, t_out, since=kill_time)
    job.stop_soon()
    return kill_time
