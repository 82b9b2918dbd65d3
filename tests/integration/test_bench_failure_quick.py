"""Temporary smoke test: the failover, heal, restart and rescale benchmarks run end to end in quick mode.

No timing assertions: only that every figure is finite, ftbridge loses no
committed step, and the heal phases add up to the heal's total.
"""

from __future__ import annotations

import math

import pytest

from ftbridge.bench import failover, heal, rescale, restart
from ftbridge.bench.core import BenchSettings


@pytest.fixture(scope="module")
def settings(tmp_path_factory):
    return BenchSettings(workdir=str(tmp_path_factory.mktemp("bench_failure")), quick=True, reps=1, timeout_s=180)


def _finite(metrics):
    assert metrics
    for m in metrics:
        assert math.isfinite(m.value) and all(math.isfinite(s) for s in m.samples), m


@pytest.mark.timeout(400)
def test_failover_quick(settings):
    metrics = failover.run(settings)
    _finite(metrics)
    lost = next(m for m in metrics if m.name.startswith("committed steps lost"))
    assert lost.samples == [0]


@pytest.mark.timeout(400)
def test_heal_quick(settings):  # reuses the failover test's kill run when run after it
    metrics = heal.run(settings)
    _finite(metrics)
    total = metrics[0]
    for rep, phases in enumerate(total.extra["phases"]):
        assert sum(phases.values()) == pytest.approx(total.samples[rep], abs=0.01)
        assert all(v >= -0.02 for v in phases.values()), phases  # /proc start time has 10 ms resolution


@pytest.mark.timeout(400)
def test_restart_quick(settings):
    metrics = restart.run(settings)
    _finite(metrics)
    assert next(m for m in metrics if m.name == "ftbridge: committed steps lost").samples == [0]


@pytest.mark.timeout(400)
def test_rescale_quick(settings):
    metrics = rescale.run(settings)
    _finite(metrics)
    assert all(v > 0 for m in metrics for v in m.samples)
