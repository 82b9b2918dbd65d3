"""PowerSGD's fragment layout on a real 2-rank ZeRO group: every fragment is where DeepSpeed put it.

With 2 ranks, ZeRO-1/2 cut the parameters straddling the partition boundary and ZeRO-3 cuts every
parameter; the worker checks each fragment's elements against a reference gradient at the
fragment's parameter offsets (tests/integration/workers/layout_worker.py).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ftbridge.launcher import find_free_port

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "layout_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(240)
def test_fragment_layout_matches_deepspeed_partitions_on_two_ranks(tmp_path):
    port = find_free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"layout{port}", WORKER]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200, check=False, env=env, cwd=str(tmp_path))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for stage in (1, 2, 3):
        for rank in (0, 1):
            assert f"LAYOUT OK stage {stage} rank {rank}" in out, out[-4000:]
