"""Tests of lighthouse/checks.py: lighthouse timeouts against the managers' settings (pure)."""

from __future__ import annotations

import logging
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from ftbridge.config import FTBridgeConfig
from lighthouse.checks import LighthouseTimeouts, ManagerTimeouts, check_timeouts, enforce

REPO = Path(__file__).resolve().parents[1]
S = timedelta(seconds=1)


def _lh(**kw):
    return LighthouseTimeouts(**{"heartbeat_timeout_ms": 3000, "join_timeout_ms": 1000, "quorum_tick_ms": 100, **kw})


def _mgr(**kw):
    base = dict(heartbeat_interval=0.1 * S, quorum_timeout=30 * S, cross_replica_timeout=10 * S, quorum_retries=5)
    return ManagerTimeouts(**{**base, **kw})


def _rules(findings):
    return [(f.level, f.rule) for f in findings]


def test_defaults_of_the_lighthouse_and_ftbridge_fit():
    from lighthouse import server

    lh = LighthouseTimeouts(heartbeat_timeout_ms=server.DEFAULT_HEARTBEAT_TIMEOUT_MS,
                            join_timeout_ms=server.DEFAULT_JOIN_TIMEOUT_MS,
                            quorum_tick_ms=server.DEFAULT_QUORUM_TICK_MS)
    assert check_timeouts(lh, ManagerTimeouts.from_config(FTBridgeConfig())) == []


@pytest.mark.parametrize("lh, mgr, expected, named", [
    (_lh(heartbeat_timeout_ms=200), _mgr(), ("ERROR", "heartbeat-interval"), "heartbeat_timeout_ms=200"),
    (_lh(heartbeat_timeout_ms=400), _mgr(), ("WARNING", "heartbeat-interval"), "heartbeat_interval=0.1 s"),
    (_lh(join_timeout_ms=60000, heartbeat_timeout_ms=40000), _mgr(), ("ERROR", "quorum-wait"), "quorum_timeout=30 s"),
    # each try resends the request, which restarts the lighthouse's straggler wait: one try must outlast it
    (_lh(join_timeout_ms=6000, heartbeat_timeout_ms=8000), _mgr(), ("ERROR", "quorum-wait"), "+ 1) = 5 s"),
    # torchft's 5000 ms: with two groups the survivor's quorum forms as the first 5 s try of its call ends
    (_lh(heartbeat_timeout_ms=5000), _mgr(), ("WARNING", "departure-wait"), "heartbeat_timeout_ms=5000"),
    (_lh(), _mgr(expected_heal_time=12 * S), ("ERROR", "heal-time"), "cross_replica_timeout=10 s"),
    (_lh(join_timeout_ms=500), _mgr(expected_heal_time=2 * S), ("WARNING", "heal-join"), "join_timeout_ms=500"),
    (_lh(), _mgr(quorum_retries=0), ("WARNING", "restart-retries"), "quorum_retries=0"),
    (_lh(), _mgr(quorum_timeout=12 * S), ("WARNING", "restart-outage"), "expected_outage=10 s"),
])
def test_each_rule_names_its_values(lh, mgr, expected, named):
    findings = check_timeouts(lh, mgr)
    assert expected in _rules(findings)
    assert named in next(f.message for f in findings if (f.level, f.rule) == expected)


def test_enforce_raises_on_errors_and_logs_warnings(caplog):
    with caplog.at_level(logging.WARNING, logger="lighthouse"):
        enforce(check_timeouts(_lh(), _mgr(quorum_retries=0)))
    assert "restart-retries" in caplog.text
    with pytest.raises(ValueError, match=r"\[heal-time\].*expected_heal_time=12 s"):
        enforce(check_timeouts(_lh(), _mgr(expected_heal_time=12 * S)))


@pytest.mark.timeout(60)
def test_cli_serve_refuses_misfitting_timeouts_with_exit_2():
    out = subprocess.run([sys.executable, "-m", "lighthouse.cli", "serve", "--bind", "127.0.0.1:0",
                          "--heartbeat-timeout-ms", "150"], cwd=REPO, capture_output=True, text=True, timeout=50,
                         check=False)
    assert out.returncode == 2 and "heartbeat_timeout_ms=150" in out.stderr and out.stdout == ""
