"""Shared fixtures: a LocalJob factory that always ends its processes, and a torchrun runner.

Multi-process tests use ephemeral ports (lighthouse on port 0, free ports for
rendezvous), a pytest timeout each, show the group logs when they fail, and
end every process they started by PID.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Iterator, List

import pytest

from ftbridge.launcher import find_free_port
from ftbridge.local_job import TRAIN_SCRIPT, LocalJob

# Small, fast model for multi-process tests (the main job's defaults are larger).
TINY = ["--n-layer", "2", "--d-model", "64", "--n-head", "4", "--context", "32", "--micro-batch", "4",
        "--val-every", "0", "--val-batches", "2", "--warmup-steps", "2"]


@pytest.fixture
def local_job(tmp_path) -> Iterator:
    """Factory ``local_job(num_groups, nproc, script_args, **kw) -> LocalJob``; all stopped at teardown."""
    jobs: List[LocalJob] = []

    def make(num_groups: int, nproc: int, script_args: List[str], **kw) -> LocalJob:
        job = LocalJob(str(tmp_path / f"job{len(jobs)}"), num_groups, nproc, script_args, **kw)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.stop()


def run_plain_deepspeed(tmp_path, nproc: int, script_args: List[str], timeout_s: float = 240) -> str:
    """Run ``scripts/train_lm.py --plain`` under torchrun with ``nproc`` ranks; return its log.

    Raises:
        AssertionError: non-zero exit, with the log.
    """
    port = find_free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"plain{port}", TRAIN_SCRIPT, "--plain",
           *script_args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    log = tmp_path / f"plain_{port}.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 15)  # torchrun stops its ranks on SIGTERM
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
            raise AssertionError(f"plain DeepSpeed run timed out after {timeout_s} s:\n{log.read_text()[-4000:]}")
    text = log.read_text()
    assert code == 0, f"plain DeepSpeed run failed ({code}):\n{text[-4000:]}"
    return text
