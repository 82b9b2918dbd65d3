"""PowerSGD's fragment layout on a real 2-rank ZeRO group: every fragment is where DeepSpeed put it.

With 2 ranks, ZeRO-1/2 cut the parameters straddling the partition boundary and ZeRO-3 cuts every
parameter; the worker checks each fragment's elements against a reference gradient at the
fragment's parameter offsets (tests/integration/workers/layout_worker.py).
"""

from __future__ import annotations

import os
import subprocess

import pytest

from ftbridge.launch.processes import torchrun_command

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "layout_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(240)
def test_fragment_layout_matches_deepspeed_partitions_on_two_ranks(tmp_path):
    cmd, env = torchrun_command(WORKER, nproc_per_node=2, environ={
        **os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])})
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200, check=False, env=env, cwd=str(tmp_path))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for stage in (1, 2, 3):
        for rank in (0, 1):
            assert f"LAYOUT OK stage {stage} rank {rank}" in out, out[-4000:]
