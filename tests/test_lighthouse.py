"""Tests of lighthouse/: the real torchft lighthouse, started in-process and by the CLI."""

from __future__ import annotations

import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from datetime import timedelta
from pathlib import Path

import pytest

from lighthouse import server
from lighthouse.server import start_lighthouse

REPO = Path(__file__).resolve().parents[1]


def _get(url: str, timeout_s: float = 5.0) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return resp.status, resp.read().decode()


@pytest.mark.timeout(60)
def test_starts_on_port_0_answers_http_and_grpc_and_frees_port_on_shutdown():
    from torchft._torchft import LighthouseClient

    lh = start_lighthouse("127.0.0.1:0", min_replicas=1)
    try:
        assert lh.port > 0
        assert lh.address == f"http://127.0.0.1:{lh.port}"
        status, body = _get(f"{lh.address}/status")
        assert status == 200
        assert "quorum" in body.lower()
        # gRPC on the same port: one group asks for a quorum and gets it alone.
        client = LighthouseClient(lh.address, timedelta(seconds=5))
        client.heartbeat("group-0")
        quorum = client.quorum("group-0", timedelta(seconds=10), step=0, world_size=1)
        assert [m.replica_id for m in quorum.participants] == ["group-0"]
    finally:
        lh.shutdown()
    with pytest.raises(urllib.error.URLError):
        _get(f"{lh.address}/status", timeout_s=2)
    # The port is free again: a new lighthouse binds it.
    with start_lighthouse(f"127.0.0.1:{lh.port}") as again:
        assert again.port == lh.port
    lh.shutdown()  # idempotent


@pytest.mark.timeout(60)
def test_shutdown_right_after_start_frees_the_port():
    # torchft's own shutdown() is lost when it comes before its server task ran
    # (1 in 20 here); LighthouseService.shutdown() must free the port anyway.
    import socket

    for _ in range(20):
        lh = start_lighthouse("127.0.0.1:0")
        lh.shutdown(timeout_s=2)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", lh.port), timeout=1).close()


@pytest.mark.timeout(60)
def test_context_manager_and_busy_port_raises_oserror():
    with start_lighthouse("127.0.0.1:0") as lh:
        with pytest.raises(OSError, match=f"127.0.0.1:{lh.port}"):
            start_lighthouse(f"127.0.0.1:{lh.port}")
        assert "serving" in repr(lh)
    assert "stopped" in repr(lh)


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"bind": "127.0.0.1"}, "bind='127.0.0.1'"),
        ({"bind": ":29510"}, "bind=':29510'"),
        ({"bind": "127.0.0.1:http"}, "bind='127.0.0.1:http'"),
        ({"bind": "127.0.0.1:70000"}, "bind='127.0.0.1:70000'"),
        ({"bind": "::1:0"}, "bind='::1:0'"),
        ({"bind": "[zz]:0"}, "bind='[zz]:0'"),
        ({"min_replicas": 0}, "min_replicas=0"),
        ({"join_timeout_ms": 0}, "join_timeout_ms=0"),
        ({"heartbeat_timeout_ms": -5}, "heartbeat_timeout_ms=-5"),
        ({"quorum_tick_ms": 0}, "quorum_tick_ms=0"),
        ({"quorum_tick_ms": 6000}, "quorum_tick_ms=6000"),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_value(kwargs, named):
    args = {"bind": "127.0.0.1:0", **kwargs}
    with pytest.raises(ValueError) as info:
        start_lighthouse(**args)
    assert named in str(info.value)


def test_parse_bind_accepts_ipv4_ipv6_and_hostnames():
    assert server.parse_bind("127.0.0.1:29510") == ("127.0.0.1", 29510)
    assert server.parse_bind("[::1]:0") == ("::1", 0)
    assert server.parse_bind("localhost:1") == ("localhost", 1)


@pytest.mark.timeout(60)
def test_non_loopback_bind_warns_about_missing_authentication(caplog):
    with caplog.at_level(logging.WARNING, logger="lighthouse"):
        with start_lighthouse("0.0.0.0:0") as lh:
            assert lh.port > 0
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    text = warnings[0].getMessage()
    assert "0.0.0.0:0" in text and "authentication" in text and "/replica/{id}/kill" in text


@pytest.mark.timeout(60)
def test_loopback_bind_does_not_warn(caplog):
    with caplog.at_level(logging.WARNING, logger="lighthouse"):
        with start_lighthouse("127.0.0.1:0"):
            pass
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def _start_cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "lighthouse.cli", *args],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _first_line(proc: subprocess.Popen, timeout_s: float) -> str:
    """The first stdout line of ``proc``, or fail after ``timeout_s`` with its stderr."""
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()
    try:
        return lines.get(timeout=timeout_s)
    except queue.Empty:
        proc.kill()
        pytest.fail(f"no address line within {timeout_s} s; stderr:\n{proc.communicate()[1]}")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_cli_serve_prints_address_and_exits_0_on_signal(sig):
    proc = _start_cli("serve", "--bind", "127.0.0.1:0", "--min-replicas", "2")
    try:
        line = _first_line(proc, timeout_s=60)
        assert line.startswith("ftbridge-lighthouse: serving on http://127.0.0.1:"), line
        address = line.split(" on ", 1)[1].strip()
        status, body = _get(f"{address}/status")
        assert status == 200 and "min_replicas 2" in body
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert "shutting down" in err
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.timeout(60)
def test_cli_rejects_bad_values_with_exit_code_2():
    proc = _start_cli("serve", "--bind", "nonsense", "--min-replicas", "1")
    try:
        out, err = proc.communicate(timeout=50)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 2
    assert "bind='nonsense'" in err and out == ""


@pytest.mark.timeout(90)
def test_cli_serve_on_all_interfaces_prints_the_authentication_warning():
    proc = _start_cli("serve", "--bind", "0.0.0.0:0", "--status-bind", "none")
    try:
        line = _first_line(proc, timeout_s=60)
        assert line.startswith("ftbridge-lighthouse: serving on http://"), line
        health = proc.stdout.readline().split(" on ", 1)[1].strip()  # 0.0.0.0:PORT, probing via loopback
        from lighthouse.health import check_health

        assert check_health(health.replace("0.0.0.0", "127.0.0.1")) == "SERVING"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        warning = next(x for x in err.splitlines() if " WARNING [lighthouse] exposed bind=" in x)
        assert "0.0.0.0:0" in warning and "NO authentication" in warning and "/replica/{id}/kill" in warning
        assert "private network" in warning
        assert "exposed --health-bind=0.0.0.0:0" in err  # the health port warns too
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
