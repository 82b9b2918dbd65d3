"""Run the main job (``scripts/train_lm.py``) for a benchmark and read what it recorded.

Two kinds of run, both ending with every rank's ``--result`` record
(``step_times_s``, ``peak_rss_bytes``, the state digest) read back:

* :func:`run_plain` — plain DeepSpeed data parallel under one torchrun world
  (:func:`ftbridge.harness.local_job.run_plain_deepspeed`), the baseline;
* :func:`run_ftbridge` — a whole ftbridge job on this machine
  (:class:`ftbridge.harness.local_job.LocalJob`: lighthouse plus ``groups`` replica
  groups of ``nproc`` ranks), which also returns each rank's ``final`` event
  (cross-replica all-reduce calls and bytes).

Runs are memoized within one process when the caller passes ``rep``: a
second request for the same kind of run, topology, flags, environment and
repetition index returns the first one's result instead of training again
(``memory`` reads peak RSS from the runs ``overhead`` timed). Pass ``rep``
only where that is sound: a step time reused from another benchmark was
taken minutes before its new partner, so the pair no longer cancels drift.

Benchmarks that inject failures start the job themselves with
:func:`ftbridge_job` (a configured, not yet started ``LocalJob``) and read it
with :func:`read_ftbridge_results` afterwards. Every run gets its own folder
under the caller's ``workdir`` (its logs stay there for a post-mortem) and
``OMP_NUM_THREADS=1`` (two processes on two cores stall for seconds otherwise).

Example::

    args = train_args(steps=40, zero_stage=2)
    plain = run_plain(os.path.join(wd, "plain"), 2, args, timeout_s=300)
    ft = run_ftbridge(os.path.join(wd, "ft"), groups=2, nproc=1, train_args=args, timeout_s=300)
    ratio = steady_median(ft.step_times_s, 10) / steady_median(plain.step_times_s, 10)
"""

from __future__ import annotations

import glob
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ftbridge.harness.bench.core import median
from ftbridge.harness.local_job import LocalJob, run_plain_deepspeed

logger = logging.getLogger("ftbridge.harness.bench")

QUICK_MODEL = {"n_layer": 2, "d_model": 64, "n_head": 4, "context": 32, "micro_batch": 4}
"""Model of ``--quick`` runs (about 0.1 M parameters)."""

MAIN_MODEL = {"n_layer": 4, "d_model": 128, "n_head": 4, "context": 128, "micro_batch": 8}
"""The main job's model (832,512 parameters), used by full runs."""


@dataclass
class JobResult:
    """What one benchmark run recorded.

    Attributes:
        results: every rank's ``--result`` record, rank order (plain: data-parallel
            rank; ftbridge: replica group, then group rank).
        finals: ftbridge only: every rank's ``final`` event, same order (empty for plain runs).
        workdir: the run's folder (logs, event logs, result files).
    """

    results: List[Dict[str, Any]]
    finals: List[Dict[str, Any]] = field(default_factory=list)
    workdir: str = ""

    @property
    def step_times_s(self) -> List[float]:
        """Per-step wall times (seconds) of the first rank, warm-up included."""
        return list(self.results[0]["step_times_s"])

    @property
    def peak_rss_bytes(self) -> List[int]:
        """Peak RSS of every rank, bytes (``KeyError`` if the job predates ``peak_rss_bytes``)."""
        return [int(r["peak_rss_bytes"]) for r in self.results]

    def cross_replica_per_step(self) -> Dict[str, float]:
        """ftbridge only: first rank's cross-replica ``allreduces``, ``bytes`` and exposed ``wait_s`` per step.

        ``wait_s``: seconds ``step()`` blocked on the all-reduce after backward
        (``FaultTolerantEngine.cross_replica_wait_s``), 0 if the record lacks it.

        Raises:
            ValueError: no ``final`` event was recorded (plain run, or the job did not finish).
        """
        if not self.finals:
            raise ValueError(f"no final event in {self.workdir}: not an ftbridge run, or it did not finish")
        f = self.finals[0]
        steps = max(int(f["step"]), 1)
        return {"allreduces": f["cross_replica_allreduces"] / steps, "bytes": f["cross_replica_bytes"] / steps,
                "wait_s": f.get("cross_replica_wait_s", 0.0) / steps}


def train_args(*, steps: int, zero_stage: int = 2, model: Optional[Dict[str, int]] = None,
               reduce_bucket_size: Optional[int] = None, extra: Sequence[str] = ()) -> List[str]:
    """Flags of ``scripts/train_lm.py`` for a benchmark run: no validation until the end, one val batch.

    Args:
        steps: optimizer steps to train (warm-up included).
        zero_stage: 1, 2 or 3.
        model: ``n_layer``, ``d_model``, ``n_head``, ``context``, ``micro_batch`` (default :data:`MAIN_MODEL`).
        reduce_bucket_size: DeepSpeed bucket size, elements (default: the job's, 50 M: one bucket).
        extra: more flags, appended.
    """
    m = {**MAIN_MODEL, **(model or {})}
    args = ["--steps", str(steps), "--zero-stage", str(zero_stage), "--val-every", "0", "--val-batches", "1",
            "--n-layer", str(m["n_layer"]), "--d-model", str(m["d_model"]), "--n-head", str(m["n_head"]),
            "--context", str(m["context"]), "--micro-batch", str(m["micro_batch"])]
    if reduce_bucket_size is not None:
        args += ["--reduce-bucket-size", str(reduce_bucket_size)]
    return args + list(extra)


_CACHE: Dict[Tuple[Any, ...], JobResult] = {}


def clear_cache() -> None:
    """Forget every memoized run (see the module docstring)."""
    _CACHE.clear()


def _cached(key: Optional[Tuple[Any, ...]], run: Callable[[], JobResult]) -> JobResult:
    if key is None:
        return run()
    if key not in _CACHE:
        _CACHE[key] = run()
    else:
        logger.info("  reusing run %s (same configuration and repetition)", _CACHE[key].workdir)
    return _CACHE[key]


def run_plain(workdir: str, nproc: int, train_args: Sequence[str], timeout_s: float,
              rep: Optional[int] = None) -> JobResult:
    """Plain DeepSpeed data parallel on ``nproc`` ranks (one torchrun world), to completion.

    Args:
        workdir: folder for this run (created; must not hold another run's results).
        nproc: ranks.
        train_args: flags of the training script (``--plain`` and ``--result`` are added).
        timeout_s: wall-clock limit, seconds.
        rep: repetition index; given, the run is memoized (see the module docstring).

    Returns:
        Every rank's result record.

    Raises:
        RuntimeError: non-zero exit or past ``timeout_s`` (processes ended), with the log tail.
    """
    def run() -> JobResult:
        os.makedirs(workdir, exist_ok=True)
        pattern = os.path.join(workdir, "result_{dp_rank}.json")
        run_plain_deepspeed(workdir, nproc, [*train_args, "--result", pattern], timeout_s)
        return JobResult([_read(pattern.format(dp_rank=r)) for r in range(nproc)], workdir=workdir)

    return _cached(None if rep is None else ("plain", nproc, tuple(train_args), rep), run)


def ftbridge_job(workdir: str, groups: int, nproc: int, train_args: Sequence[str], *,
                 env: Optional[Dict[str, str]] = None, **job_kw: Any) -> LocalJob:
    """A configured (not started) :class:`LocalJob` whose ranks write their result records to ``workdir``.

    Args:
        workdir: folder for this run (created).
        groups: replica groups; nproc: ranks per group.
        train_args: flags of the training script (``--result`` is added).
        env: extra environment of every rank (e.g. ``FTBRIDGE_SYNC_MODE``); ``OMP_NUM_THREADS=1`` unless set.
        job_kw: more :class:`LocalJob` arguments. ``min_replicas`` and
            ``lighthouse_min_replicas`` default to ``groups`` (all groups start
            together: right for steady state; pass ``min_replicas=1`` and
            ``lighthouse_min_replicas=1`` for a run that kills a group).

    Use as a context manager (it ends every process on exit), then
    :func:`read_ftbridge_results`.
    """
    result = os.path.join(os.path.abspath(workdir), "result_{replica_group}_{group_rank}.json")
    job_kw.setdefault("min_replicas", groups)
    job_kw.setdefault("lighthouse_min_replicas", job_kw["min_replicas"])
    job_kw.setdefault("checksum_every", None)  # what users run: the library default, not the tests' every step
    return LocalJob(workdir, groups, nproc, [*train_args, "--result", result],
                    env={"OMP_NUM_THREADS": "1", **(env or {})}, **job_kw)


def read_ftbridge_results(job: LocalJob, groups: Optional[Sequence[int]] = None) -> JobResult:
    """Result records and ``final`` events of every rank of a finished :func:`ftbridge_job`.

    Args:
        job: the job, its groups exited.
        groups: read only these replica groups (default all; leave out a group that left for good).

    Raises:
        RuntimeError: a rank wrote no result record (it failed or is still running), with the log tails.
    """
    results, finals = [], []
    for g in range(job.num_groups) if groups is None else groups:
        for r in range(job.nproc):
            path = os.path.join(job.workdir, f"result_{g}_{r}.json")
            if not os.path.exists(path):
                raise RuntimeError(f"replica group {g} rank {r} wrote no result ({path})\n{job.tails()}")
            results.append(_read(path))
            finals += [e for e in job.events(g, r) if e.get("event") == "final"][-1:]
    return JobResult(results, finals, job.workdir)


def run_ftbridge(workdir: str, groups: int, nproc: int, train_args: Sequence[str], *, timeout_s: float,
                 env: Optional[Dict[str, str]] = None, rep: Optional[int] = None, **job_kw: Any) -> JobResult:
    """An ftbridge job of ``groups`` x ``nproc`` ranks, started together and run to completion.

    Args:
        workdir, groups, nproc, train_args, env, job_kw: as :func:`ftbridge_job`;
            ``max_restarts`` defaults to 0 here (a failing rank fails the run at once).
        timeout_s: wall-clock limit, seconds.
        rep: repetition index; given, the run is memoized (see the module docstring).

    Returns:
        Every rank's result record and ``final`` event.

    Raises:
        RuntimeError: a group exited non-zero or wrote no result, with the log tails.
        TimeoutError: a group still runs after ``timeout_s`` (every process is ended).
    """
    job_kw.setdefault("max_restarts", 0)

    def run() -> JobResult:
        with ftbridge_job(workdir, groups, nproc, train_args, env=env, **job_kw) as job:
            job.start()
            wait_all_or_first_failure(job, timeout_s)
            return read_ftbridge_results(job)

    key = ("ftbridge", groups, nproc, tuple(train_args), tuple(sorted((env or {}).items())),
           tuple(sorted(job_kw.items())), rep)
    return _cached(None if rep is None else key, run)


def wait_all_or_first_failure(job: LocalJob, timeout_s: float, poll_s: float = 0.2) -> None:
    """Wait until every group of ``job`` exited 0; stop at the first non-zero exit.

    A group that fails leaves the others waiting for a quorum that needs it
    (the lighthouse's ``min_replicas``), so waiting for all would cost the whole timeout.

    Raises:
        RuntimeError: a group exited non-zero (exit codes so far and the log tails).
        TimeoutError: a group still runs after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        codes = {g: launches[-1].proc.poll() for g, launches in job.groups.items()}
        if any(c not in (None, 0) for c in codes.values()):
            raise RuntimeError(f"ftbridge run in {job.workdir} failed, exit codes {codes}\n{job.tails()}")
        if all(c == 0 for c in codes.values()):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"ftbridge run in {job.workdir} still running after {timeout_s} s, exit codes "
                               f"{codes}\n{job.tails()}")
        time.sleep(poll_s)


def steady_median(step_times_s: Sequence[float], warmup_steps: int) -> float:
    """Median step time after dropping the first ``warmup_steps`` (seconds).

    Raises:
        ValueError: no step is left after the warm-up.
    """
    timed = list(step_times_s)[warmup_steps:]
    if not timed:
        raise ValueError(f"{len(step_times_s)} steps recorded, all within the {warmup_steps} warm-up steps")
    return median(timed)


def alternate(reps: int, first: Callable[[int], float], second: Callable[[int], float],
              log: Optional[Callable[[str], None]] = None) -> Tuple[List[float], List[float]]:
    """Paired repetitions: ``first(rep)`` and ``second(rep)`` each rep, the order swapped every other rep.

    Alternating cancels a slow drift of the machine (another job, thermal) between the pair.

    Returns:
        ``(first_samples, second_samples)``, one value each per repetition.
    """
    a, b = rotate(reps, [first, second])
    (log or logger.info)(f"  paired {reps} rep(s): {_fmt(a)} vs {_fmt(b)}")
    return a, b


def rotate(reps: int, fns: Sequence[Callable[[int], float]]) -> List[List[float]]:
    """Grouped repetitions of several runs: each rep calls every ``fns[i](rep)`` once, the order rotated by one
    each rep.

    The generalisation of :func:`alternate` to more than two configurations
    sharing one baseline: each configuration leads equally often over the reps.

    Returns:
        ``samples[i]``: the values of ``fns[i]``, one per repetition.
    """
    out: List[List[float]] = [[] for _ in fns]
    for rep in range(reps):
        for k in range(len(fns)):
            i = (k + rep) % len(fns)
            out[i].append(fns[i](rep))
    return out


def _fmt(values: Sequence[float]) -> str:
    return "[" + ", ".join(f"{v:.4g}" for v in values) + "]"


def next_run_dir(parent: str, name: str) -> str:
    """A fresh folder ``parent/name.N`` (N counts up), so repeated runs keep their logs apart."""
    os.makedirs(parent, exist_ok=True)
    n = len(glob.glob(os.path.join(parent, f"{name}.*")))
    return os.path.join(parent, f"{name}.{n}")


def model_params(model: Optional[Dict[str, int]] = None) -> int:
    """Parameter count of the job's model with these ``n_layer``/``d_model``/``n_head``/``context``."""
    from ftbridge.harness.data import CharTokenizer, load_text
    from ftbridge.harness.models import GPTConfig, build_model

    m = {**MAIN_MODEL, **(model or {})}
    vocab = CharTokenizer(load_text(None)).vocab_size
    net = build_model(GPTConfig(vocab_size=vocab, context=m["context"], n_layer=m["n_layer"], n_head=m["n_head"],
                                d_model=m["d_model"]), seed=0)
    return sum(p.numel() for p in net.parameters())


def _read(path: str) -> Dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)
