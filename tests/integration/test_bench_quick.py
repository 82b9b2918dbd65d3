"""The CI smoke run of ``ftbridge-bench --quick``: benchmarks run end to end and write their report.

The default suite runs the benchmarks whose checks guard a claim (overhead and the divergence guard,
failover, heal, restart, memory); the informative ones with their own tests elsewhere (overlap, rescale:
tests/integration/test_checkpoints.py, scaling) add about 100 s on 2 cores, so the run of every
benchmark is marked slow (``.ci/run-slow``).

Runs the CLI as a subprocess (``python -m ftbridge.harness.bench.cli``, what the
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

from ftbridge.launch.processes import stop_process_groups

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

EXPECTED = {
    # benchmark: metrics it reports in quick mode (None: at least one)
    "overhead": 3,  # ZeRO-2 only in quick mode; the commit protocol's share of a step; the divergence guard's cost
    "overlap": 1,
    "failover": None,
    "heal": None,
    "restart": None,
    "rescale": None,
    "memory": 1,
    "scaling": 8,  # groups 1, 2; two model sizes; cost and exposed wait of each
    "slots": 3,
}


def _metric(saved, bench, name):
    return next(m for m in saved["metrics"] if m["benchmark"] == bench and m["name"].startswith(name))


def _quick_model_parameters() -> int:
    """Parameters of the kill runs' quick model (ftbridge.harness.bench.failure_jobs.QUICK_MODEL) on the corpus."""
    from ftbridge.harness.bench.failure_jobs import QUICK_MODEL
    from ftbridge.harness.data import CharTokenizer, load_text
    from ftbridge.harness.models.char_gpt import GPTConfig, build_model

    flags = dict(zip(QUICK_MODEL[::2], QUICK_MODEL[1::2]))
    cfg = GPTConfig(vocab_size=CharTokenizer(load_text()).vocab_size, context=int(flags["--context"]),
                    n_layer=int(flags["--n-layer"]), n_head=int(flags["--n-head"]), d_model=int(flags["--d-model"]))
    return sum(p.numel() for p in build_model(cfg, seed=0).parameters())


def test_quick_model_size_is_what_the_heal_bytes_check_assumes():
    assert _quick_model_parameters() == 113_536


# The default suite's subset: every benchmark with a claim checked below ("memory" reuses overhead's runs).
CLAIMS = ["overhead", "failover", "heal", "restart", "memory"]


@pytest.mark.timeout(1200)
def test_quick_claims_write_their_metrics_and_plots(tmp_path):
    _run_quick_and_check(tmp_path, CLAIMS)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_quick_suite_writes_every_metric_and_plot(tmp_path):
    _run_quick_and_check(tmp_path, None)


def _run_quick_and_check(tmp_path, only):
    """Run ``ftbridge-bench --quick`` (``--only`` the named benchmarks unless None) and check its report."""
    out = tmp_path / "bench"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    log = tmp_path / "bench.log"
    with open(log, "wb") as f:  # its own session: on a timeout the CLI and every job it started go
        proc = subprocess.Popen([sys.executable, "-m", "ftbridge.harness.bench.cli", "--quick", "--out", str(out),
                                 *(["--only", ",".join(only)] if only else [])],
                                cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=1140)
        except subprocess.TimeoutExpired:  # on SIGTERM the CLI stops its jobs and writes the partial report
            stop_process_groups([proc], grace_s=60, kill_wait_s=None)
            code = "timeout"
    if code != 0:  # the failed benchmarks' own errors first (with their jobs' log tails), then the log's end
        report = out / "bench.json"
        failed = json.loads(report.read_text())["failures"] if report.exists() else []
        errors = "\n".join(f["error"][-4000:] for f in failed)
        pytest.fail(f"exit {code}\n{errors}\n--- bench log, last lines ---\n{log.read_text(errors='replace')[-4000:]}")
    saved = json.loads((out / "bench.json").read_text())
    assert saved["failures"] == [] and saved["plot_errors"] == {}
    for name, count in EXPECTED.items():
        if only and name not in only:
            continue
        ms = [m for m in saved["metrics"] if m["benchmark"] == name]
        assert len(ms) == count if count else ms, (name, [m["name"] for m in ms])
        for m in ms:
            assert math.isfinite(m["value"]) and m["samples"] and all(math.isfinite(v) for v in m["samples"]), m
        assert (out / f"{name}.png").stat().st_size > 5_000, name
    assert (out / "overview.png").stat().st_size > 5_000
    if not only or "overlap" in only:
        overlap = next(m for m in saved["metrics"] if m["benchmark"] == "overlap")
        assert overlap["extra"]["messages_per_step"] >= 8  # the model really had >= 8 buckets
    guard = _metric(saved, "overhead", "divergence guard")
    assert all(s > 0 for s in guard["extra"]["per_check_s"])  # the guard really ran checks
    memory = next(m for m in saved["metrics"] if m["benchmark"] == "memory")
    assert memory["baseline"] > 50  # MiB: peak RSS was recorded, not zero
    # Recovery: ftbridge loses no committed step, and the heal shipped the whole optimizer state.
    assert _metric(saved, "failover", "committed steps lost")["samples"] == [0]
    assert _metric(saved, "restart", "ftbridge: committed steps lost")["samples"] == [0]
    heal = _metric(saved, "heal", "restart to first commit")
    for phases in heal["extra"]["phases"]:
        assert all(v >= -0.02 for v in phases.values()), phases  # /proc start time has 10 ms resolution
    # One rank per group (ZeRO-2): the heal carries fp32 master weights and Adam's two moments of every
    # parameter of the quick model, 12 bytes each (measured: 12 x 113,536 + 4.5 kB of header and
    # counters); a heal that skipped the optimizer state or shipped a partition would be far smaller.
    params = _quick_model_parameters()
    for nbytes in _metric(saved, "heal", "heal transfer throughput")["extra"]["bytes"]:
        assert 12 * params <= nbytes <= 12 * params + 64 * 1024, (nbytes, params)
    md = (out / "bench.md").read_text()
    assert md.count("\n| ") == 1 + len(saved["metrics"])  # header + one row per metric
