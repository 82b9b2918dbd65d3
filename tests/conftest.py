"""Shared fixtures: a LocalJob factory that always ends its processes, and a torchrun runner.

Multi-process tests use ephemeral ports (lighthouse on port 0, free ports for
rendezvous), a pytest timeout each, show the group logs when they fail, and
end every process they started by PID.
"""

from __future__ import annotations

import os
from typing import Iterator, List

import pytest
import torch.distributed as dist

import ftbridge.harness.local_job as local_job_module
from ftbridge.harness.local_job import LocalJob
from ftbridge.launch.build_lock import prepare_jit_build

prepare_jit_build()  # as ftbridge's entry points do; every process a test starts inherits it

# The suite trains on the CPU even on a GPU machine (train_lm.py --device auto keeps a preset CPU
# accelerator): its multi-rank groups need a GPU per rank otherwise. GPU checks are marked cuda.
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` need a CUDA GPU: skipped with the reason where torch sees none."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False); runs in "
                                   "scripts/device_check.sh on a GPU machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


# Small, fast model for multi-process tests (the main job's defaults are larger).
TINY = ["--n-layer", "2", "--d-model", "64", "--n-head", "4", "--context", "32", "--micro-batch", "4",
        "--val-every", "0", "--val-batches", "2", "--warmup-steps", "2"]


@pytest.fixture
def local_job(request, tmp_path) -> Iterator:
    """Factory ``local_job(num_groups, nproc, script_args, **kw) -> LocalJob``; all stopped at teardown.

    When the test fails, its report gets a section per job with what every process it started printed
    last and every failure line (exit codes, signals, errors, timeouts: :meth:`LocalJob.tails`), so one
    failure in CI is enough to diagnose."""
    jobs: List[LocalJob] = []
    request.node.ftbridge_jobs = jobs

    def make(num_groups: int, nproc: int, script_args: List[str], **kw) -> LocalJob:
        job = LocalJob(str(tmp_path / f"job{len(jobs)}"), num_groups, nproc, script_args, **kw)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed multi-process test shows its processes' failure lines (see :func:`local_job`)."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed:
        for i, job in enumerate(getattr(item, "ftbridge_jobs", [])):
            try:
                report.sections.append((f"ftbridge job {i} ({job.workdir}): processes", job.tails()))
            except Exception as exc:  # noqa: BLE001 - the report must not fail on a job it cannot read
                report.sections.append((f"ftbridge job {i}", f"could not read its logs: {exc!r}"))


def run_plain_deepspeed(tmp_path, nproc: int, script_args: List[str], timeout_s: float = 240) -> str:
    """``ftbridge.harness.local_job.run_plain_deepspeed`` with a test failure (and the log) on error."""
    try:
        return local_job_module.run_plain_deepspeed(str(tmp_path), nproc, script_args, timeout_s)
    except RuntimeError as e:
        raise AssertionError(str(e)) from None


@pytest.fixture(scope="session")
def single_rank_world(tmp_path_factory) -> Iterator[None]:
    """One gloo world of one rank for every in-process DeepSpeed test of the session.

    DeepSpeed caches its process groups, so a second world created after a
    first was destroyed breaks the engines built on it: the world is created
    once and destroyed at the end of the session.
    """
    saved = {k: os.environ.get(k) for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    os.environ.update({"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1"})  # DeepSpeed insists on them
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if not dist.is_initialized():
        store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
