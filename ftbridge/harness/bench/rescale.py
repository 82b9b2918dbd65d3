"""Scale change: resume at another size, ftbridge against DeepSpeed's universal checkpoint.

A job of 2·M ranks resumes on M ranks (M = 2; 1 in quick mode), same model
(main job's; tiny in quick mode), ZeRO-2:

* **plain DeepSpeed** data parallel over 2·M ranks saves with
  ``save_checkpoint``; another world size needs a conversion
  (``python -m deepspeed.checkpoint.ds_to_universal --inject_missing_state``,
  a subprocess, timed) and a ``load_universal`` load on M ranks.
* **ftbridge**: a real job of N = 2 replica groups x M ranks
  (:class:`~ftbridge.harness.local_job.LocalJob`, ``--checkpoint-every``) trains and
  writes its replica-group checkpoint; the run checks that the checkpoint's
  quorum held N groups, then resumes with 1 group of M ranks (M groups != N),
  loading it directly (manifest check, DeepSpeed ``load_checkpoint``), no
  conversion. Per group the world size does not change (the groups do), which
  is what lets ftbridge skip the conversion; the loaded step is checked.

Measured, per repetition (loads alternate plain and ftbridge): *checkpoint to
loaded state* (plain: conversion + load; ftbridge: verify + load, both timed
inside the loading process after ``deepspeed.initialize``) and *end to end*
(plain: conversion + the whole loading torchrun; ftbridge: the loading
torchrun). Reported as ftbridge / plain ratios; the issue sets no number, the
target here is "ftbridge faster" (<= 1.0). Folded in from
``scripts/bench_checkpoint.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from typing import Dict, List

from ftbridge.harness.bench import failure_jobs
from ftbridge.harness.bench.core import BenchSettings, Metric, benchmark, median, ratio_metric, save_figure
from ftbridge.harness.local_job import LocalJob

NAME = "rescale"
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rescale_worker.py")


def convert_universal(out: str, timeout_s: float) -> float:
    """Convert ``out/ds_resume``'s latest checkpoint with ``ds_to_universal``; returns seconds (process wall).

    Writes ``<tag>_universal`` and ``latest_universal`` (a previous conversion is removed first).

    Raises:
        subprocess.CalledProcessError: the conversion failed (its output attached).
        subprocess.TimeoutExpired: it ran past ``timeout_s``.
    """
    root = os.path.join(out, "ds_resume")
    with open(os.path.join(root, "latest"), encoding="utf-8") as f:
        tag = f.read().strip()
    dest = os.path.join(root, f"{tag}_universal")
    shutil.rmtree(dest, ignore_errors=True)
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                    os.path.join(root, tag), "--output_folder", dest, "--inject_missing_state"],
                   check=True, capture_output=True, timeout=timeout_s, env={**os.environ, "OMP_NUM_THREADS": "1"})
    elapsed = time.perf_counter() - t
    with open(os.path.join(root, "latest_universal"), "w", encoding="utf-8") as f:
        f.write(f"{tag}_universal")
    return elapsed


SAVE_STEP = 3
"""Steps the saving jobs train before their checkpoint."""


def ftbridge_save(out: str, settings: BenchSettings, groups: int, ranks: int) -> dict:
    """Train a real ftbridge job of ``groups`` x ``ranks`` to :data:`SAVE_STEP`; it writes ``out/ft_resume``.

    Returns:
        The checkpoint's metadata (``ftbridge.json``).

    Raises:
        RuntimeError: the job did not exit 0 or wrote no checkpoint at :data:`SAVE_STEP` from a quorum of
            ``groups`` groups.
        TimeoutError: the job ran past ``settings.timeout_s``.
    """
    from ftbridge.checkpoint.store import CheckpointStore

    root = os.path.join(out, "ft_resume")
    args = [*failure_jobs.model_args(settings), "--steps", str(SAVE_STEP), "--checkpoint-dir", root,
            "--checkpoint-every", str(SAVE_STEP)]
    job = LocalJob(os.path.join(out, "ft_save_job"), groups, ranks, args, min_replicas=groups,
                   lighthouse_min_replicas=groups, env={"OMP_NUM_THREADS": "1"})
    with job:
        job.start()
        codes = job.wait(settings.timeout_s)
    if set(codes.values()) != {0}:
        raise RuntimeError(f"the saving ftbridge job exited {codes}:\n{job.tails()}")
    ckpt = CheckpointStore(root).find_valid()
    meta = ckpt.metadata() if ckpt is not None else {}
    if meta.get("step") != SAVE_STEP or meta.get("quorum", {}).get("participants") != groups:
        raise RuntimeError(f"expected a checkpoint of step {SAVE_STEP} from {groups} replica groups in {root}, "
                           f"found {meta or 'none'}")
    return meta


def plot(metrics: List[Metric], png_path: str) -> None:
    """Stacked bars: plain (conversion + load) against ftbridge (load), checkpoint to loaded state and end to end."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = next(m for m in metrics if "convert_s" in m.extra).extra
    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3.2))
    a.bar(["plain DS", "ftbridge"], [median(x["convert_s"]), 0], label="ds_to_universal", color="tab:gray")
    a.bar(["plain DS", "ftbridge"], [median(x["plain_load_s"]), median(x["ft_load_s"])],
          bottom=[median(x["convert_s"]), 0], label="load", color="tab:blue")
    a.set_title("checkpoint to loaded state")
    a.set_ylabel("seconds")
    a.legend(fontsize=7)
    b.bar(["plain DS", "ftbridge"], [median(x["convert_s"]), 0], color="tab:gray")
    b.bar(["plain DS", "ftbridge"], [median(x["plain_proc_s"]), median(x["ft_proc_s"])],
          bottom=[median(x["convert_s"]), 0], color="tab:cyan", label="loading process (start-up included)")
    b.set_title("end to end")
    b.legend(fontsize=7)
    save_figure(fig, png_path)


@benchmark(NAME, plot=plot)
def run(settings: BenchSettings) -> List[Metric]:
    """Resume 2·M ranks on M, plain (universal conversion) against ftbridge (none); see the module docstring.

    Raises:
        RuntimeError: a worker or the saving job failed (its output attached), or a load resumed at
            another step than the one saved.
        subprocess.TimeoutExpired: a worker or the conversion ran past ``settings.timeout_s``.
    """
    m = 1 if settings.quick else 2
    flags = ["--", *failure_jobs.model_args(settings)]
    out = os.path.join(os.path.abspath(settings.workdir), "rescale")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    to = settings.timeout_s
    groups_before, groups_after = 2, 1
    failure_jobs.torchrun(2 * m, WORKER, ["--worker", "plain_save", "--out", out, *flags], to)  # not timed
    ftbridge_save(out, settings, groups_before, m)  # not timed
    x: Dict[str, List[float]] = {k: [] for k in ("convert_s", "plain_load_s", "plain_proc_s", "ft_load_s", "ft_proc_s")}
    for _ in range(1 if settings.quick else settings.reps):
        x["convert_s"].append(convert_universal(out, to))
        for kind, prefix in (("universal", "plain"), ("ftbridge", "ft")):
            x[f"{prefix}_proc_s"].append(failure_jobs.torchrun(m, WORKER, ["--worker", f"load_{kind}", "--out", out,
                                                                             *flags], to))
            with open(os.path.join(out, f"load_{kind}.json"), encoding="utf-8") as f:
                loaded = json.load(f)
            if loaded["global_steps"] != SAVE_STEP:
                raise RuntimeError(f"load_{kind} resumed at step {loaded['global_steps']}, saved at {SAVE_STEP}")
            x[f"{prefix}_load_s"].append(loaded["load_s"])
    plain_ckpt = [c + ld for c, ld in zip(x["convert_s"], x["plain_load_s"])]
    plain_e2e = [c + p for c, p in zip(x["convert_s"], x["plain_proc_s"])]
    extra = dict(x, ranks_before=2 * m, ranks_after=m, groups_before=groups_before, groups_after=groups_after)
    shape = f"{2 * m} -> {m} ranks ({groups_before} -> {groups_after} replica groups of {m})"
    return [
        ratio_metric(NAME, f"checkpoint to loaded state, {shape}: ftbridge / plain", x["ft_load_s"],
                     plain_ckpt, baseline_name="ds_to_universal + load_universal (s)", target_max=1.0, extra=extra),
        ratio_metric(NAME, f"end to end, {shape}: ftbridge / plain", x["ft_proc_s"], plain_e2e,
                     baseline_name="ds_to_universal + loading torchrun (s)", target_max=1.0),
        Metric(NAME, "plain DeepSpeed: ds_to_universal", median(x["convert_s"]), "s", x["convert_s"]),
        Metric(NAME, "plain DeepSpeed: load_universal", median(x["plain_load_s"]), "s", x["plain_load_s"]),
        Metric(NAME, "ftbridge: verify + load", median(x["ft_load_s"]), "s", x["ft_load_s"]),
    ]
