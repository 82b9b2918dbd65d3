"""A short seeded chaos run with one failure of every kind (the CI smoke run of ftbridge-chaos).

3 replica groups x 2 ranks, tiny model. Every failure must be injected (none
skipped), recovered from within the bound that follows from the timeouts, and
every invariant must hold: commits monotonic, no committed step lost, replicas
identical after every commit, identical final state, no process left behind.
The final-loss comparison with a failure-free run is left to the soak script
and to tests/integration/test_chaos_scenarios.py (it doubles this test's time).
"""

from __future__ import annotations

import json
import os

import pytest

from ftbridge.harness.chaos import report
from ftbridge.harness.chaos.cli import TINY
from ftbridge.harness.chaos.runner import ChaosSettings, run_chaos
from ftbridge.harness.chaos.schedule import FailureKind, make_schedule


@pytest.mark.timeout(600)
def test_every_failure_kind_once_all_invariants_hold(tmp_path):
    schedule = make_schedule(seed=3, kinds=list(FailureKind), num_groups=3, mtbf_s=2.0, hang_s=8.0)
    settings = ChaosSettings(workdir=str(tmp_path / "run"), groups=3, nproc=2, script_args=TINY, seed=3,
                             cross_replica_timeout_s=5.0, baseline=False)
    result = run_chaos(settings, schedule)
    paths = report.write(result, str(tmp_path / "report"))

    assert not [o.injected.failure.kind.value for o in result.outcomes if o.injected.skipped]
    assert {o.injected.failure.kind for o in result.outcomes} == set(FailureKind)
    assert all(o.recovered for o in result.outcomes), report.table(result)
    assert result.violations == [], report.table(result)
    assert result.leftover_pids == []
    # Heals happened where they must: every hit group came back by healing.
    for o in result.outcomes:
        if o.injected.rejoin:
            assert o.recovery.rejoin_s is not None, o.to_json()
    summary = json.loads(open(paths[0], encoding="utf-8").read())
    assert summary["ok"] and summary["heals"] >= 6
    assert os.path.getsize(paths[2]) > 10_000  # the plot
