"""Tests of lighthouse/health.py: gRPC health across a lighthouse stop and start, the offline status page."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ftbridge.manager.lighthouse_status import Heartbeat, parse_status
from lighthouse.health import LIGHTHOUSE_SERVICE, LighthouseMonitor, check_health, render_page
from lighthouse.metrics import registry_for
from lighthouse.server import start_lighthouse
from tests.test_lighthouse_status import FRAGMENT

REPO = Path(__file__).resolve().parents[1]


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.mark.timeout(90)
def test_health_serving_not_serving_serving_across_a_lighthouse_stop_and_start():
    lh = start_lighthouse("127.0.0.1:0")
    port = lh.port
    mon = LighthouseMonitor(lh.address, health_bind="127.0.0.1:0", status_bind="127.0.0.1:0", probe_interval_s=0.2)
    health = mon.health_address
    try:
        assert check_health(health) == "SERVING"
        assert check_health(health, LIGHTHOUSE_SERVICE) == "SERVING"
        assert _get(f"http://{mon.page.address}/healthz") == (200, "SERVING\n")

        lh.shutdown()
        _wait_for(lambda: check_health(health) == "NOT_SERVING", 30, "NOT_SERVING after the stop")
        assert check_health(health, LIGHTHOUSE_SERVICE) == "NOT_SERVING"
        code, body = _get(f"http://{mon.page.address}/healthz")
        assert code == 503 and body == "NOT_SERVING\n"
        code, page = _get(f"http://{mon.page.address}/")
        assert code == 200 and "NOT_SERVING" in page and "last known state" in page

        lh = start_lighthouse(f"127.0.0.1:{port}")
        _wait_for(lambda: check_health(health) == "SERVING", 30, "SERVING after the restart")
        code, data = _get(f"http://{mon.page.address}/status.json")
        assert code == 200 and json.loads(data)["serving"] is True
    finally:
        mon.shutdown()
        lh.shutdown()


@pytest.mark.timeout(60)
def test_monitor_of_an_absent_lighthouse_starts_not_serving():
    with start_lighthouse("127.0.0.1:0") as lh:
        address = lh.address
    with LighthouseMonitor(address, health_bind="127.0.0.1:0", probe_interval_s=0.2) as mon:
        assert check_health(mon.health_address) == "NOT_SERVING"
        assert mon.last_error


def test_lighthouse_metrics_from_the_last_probe():
    """Figures of the last snapshot; a restarted group (two replica ids) reports its freshest heartbeat."""
    status = parse_status(FRAGMENT)
    mon = SimpleNamespace(_lock=threading.Lock(), last_status=status, serving=False,
                          last_success_monotonic=time.monotonic())
    got = {(s.name, tuple(s.labels.items())): s.value for fam in registry_for(mon).collect() for s in fam.samples}
    assert got[("ftbridge_lighthouse_up", ())] == 0  # health from the last probe, figures from the last success
    assert got[("ftbridge_lighthouse_quorum_id", ())] == 1
    assert got[("ftbridge_lighthouse_participants", ())] == 2
    assert got[("ftbridge_lighthouse_heartbeating_groups", ())] == 1  # group 1's heartbeat is stale
    assert 0.019 <= got[("ftbridge_lighthouse_seconds_since_last_quorum", ())] < 5
    assert 7.5 <= got[("ftbridge_lighthouse_heartbeat_age_seconds", (("replica_group", "1"),))] < 12
    restarted = Heartbeat("replica_group_1:uuid2", age_s=0.5, stale=False)
    mon.last_status = dataclasses.replace(status, heartbeats=[restarted, *status.heartbeats])
    got = {(s.name, tuple(s.labels.items())): s.value for fam in registry_for(mon).collect() for s in fam.samples}
    assert 0.5 <= got[("ftbridge_lighthouse_heartbeat_age_seconds", (("replica_group", "1"),))] < 5
    mon.last_status = None
    assert [f.name for f in registry_for(mon).collect()] == ["ftbridge_lighthouse_up"]


def test_status_page_is_self_contained():
    page = render_page(parse_status(FRAGMENT), lighthouse="http://h:1", serving=True, error=None)
    assert "<script" not in page and "http://" not in page.replace("http://h:", "").replace("http-equiv", "")
    assert "src=" not in page and "<link" not in page and "@import" not in page
    assert "replica_group_0:uuid0" in page and "recovering" in page and 'http-equiv="refresh"' in page


@pytest.mark.timeout(90)
def test_cli_serve_prints_health_and_page_and_health_command_checks_it():
    proc = subprocess.Popen([sys.executable, "-m", "lighthouse.cli", "serve", "--bind", "127.0.0.1:0"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = [proc.stdout.readline() for _ in range(3)]  # the test's timeout bounds these reads
        assert lines[0].startswith("ftbridge-lighthouse: serving on http://127.0.0.1:"), lines
        health = lines[1].split(" on ", 1)[1].strip()
        page = lines[2].split(" on ", 1)[1].strip()
        out = subprocess.run([sys.executable, "-m", "lighthouse.cli", "health", health],
                             cwd=REPO, capture_output=True, text=True, timeout=50, check=False)
        assert out.returncode == 0 and json.loads(out.stdout)["status"] == "SERVING", out
        code, body = _get(page)
        assert code == 200 and "SERVING" in body
        code, text = _get(page + "metrics")  # Prometheus text from the same status port
        got = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
        assert code == 200 and got["ftbridge_lighthouse_up"] == 1 and got["ftbridge_lighthouse_quorum_id"] == 0
        assert got["ftbridge_lighthouse_participants"] == 0 and got["ftbridge_lighthouse_heartbeating_groups"] == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        out = subprocess.run([sys.executable, "-m", "lighthouse.cli", "health", health, "--timeout-s", "1"],
                             cwd=REPO, capture_output=True, text=True, timeout=50, check=False)
        assert out.returncode == 1 and "UNREACHABLE" in out.stdout
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def test_side_ports_follow_the_bind_port_so_two_lighthouses_fit_on_one_machine():
    from lighthouse.cli import _side_bind

    assert _side_bind(None, "127.0.0.1:29510", 1) == "127.0.0.1:29511"
    assert _side_bind(None, "127.0.0.1:29610", 2) == "127.0.0.1:29612"   # a second lighthouse's own ports
    assert _side_bind(None, "127.0.0.1:0", 2) == "127.0.0.1:0"
    assert _side_bind("none", "127.0.0.1:29510", 1) is None
    with pytest.raises(ValueError, match="no room"):
        _side_bind(None, "127.0.0.1:65535", 1)


def test_a_taken_health_port_is_refused_not_shared():
    import socket

    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)   # as gRPC's default would
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"health_bind='127.0.0.1:{port}'"):
            LighthouseMonitor("http://127.0.0.1:9", health_bind=f"127.0.0.1:{port}", status_bind=None,
                              probe_interval_s=60)
