"""The CI smoke run of ``ftbridge-bench --quick``: every benchmark runs end to end and writes its report.

Runs the CLI as a subprocess (``python -m ftbridge.bench.cli``, what the
``ftbridge-bench`` console script calls) with a timeout, then checks that
``bench.json`` holds every expected metric with a finite value, that nothing
failed, and that the plots exist. No assertion on time: quick figures come
from one repetition of a few steps and are noise.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

EXPECTED = {
    # benchmark: metrics it reports in quick mode
    "overhead": 1,  # ZeRO-2 only in quick mode
    "overlap": 1,
    "memory": 1,
    "scaling": 4,  # groups 1, 2; two model sizes
}


@pytest.mark.timeout(900)
def test_quick_suite_writes_every_metric_and_plot(tmp_path):
    out = tmp_path / "bench"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-m", "ftbridge.bench.cli", "--quick", "--only", ",".join(EXPECTED),
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-6000:]}"
    saved = json.loads((out / "bench.json").read_text())
    assert saved["failures"] == [] and saved["plot_errors"] == {}
    for name, count in EXPECTED.items():
        ms = [m for m in saved["metrics"] if m["benchmark"] == name]
        assert len(ms) == count, (name, [m["name"] for m in ms])
        for m in ms:
            assert math.isfinite(m["value"]) and m["samples"] and all(math.isfinite(v) for v in m["samples"]), m
        assert (out / f"{name}.png").stat().st_size > 5_000, name
    assert (out / "overview.png").stat().st_size > 5_000
    overlap = next(m for m in saved["metrics"] if m["benchmark"] == "overlap")
    assert overlap["extra"]["messages_per_step"] >= 8  # the model really had >= 8 buckets
    memory = next(m for m in saved["metrics"] if m["benchmark"] == "memory")
    assert memory["baseline"] > 50  # MiB: peak RSS was recorded, not zero
    md = (out / "bench.md").read_text()
    assert md.count("\n| ") == 1 + sum(EXPECTED.values())  # header + one row per metric
