"""Unit tests of ftbridge/launch/supervise.py: the launcher's processes tagged, ended and escalated."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from ftbridge.launch import supervise


@pytest.mark.timeout(30)
def test_kill_tagged_ends_processes_carrying_the_launch_id():
    env = {**os.environ, supervise.LAUNCH_ID_ENV: "unit-test-tag"}
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env,
                             start_new_session=True)
    try:
        assert child.pid in supervise.tagged_processes("unit-test-tag")
        assert child.pid not in supervise.tagged_processes("other-tag")
        assert supervise.kill_tagged("unit-test-tag", grace_s=5) == [child.pid]
        assert child.wait(timeout=10) == -signal.SIGTERM
        assert supervise.tagged_processes("unit-test-tag") == []
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
            child.wait()


@pytest.mark.timeout(30)
def test_kill_tagged_never_sigkills_a_pid_that_lost_its_tag(monkeypatch):
    # The tagged process ended after SIGTERM and its PID now belongs to another (untagged) process that
    # ignores SIGTERM: SIGKILL must not reach it.
    other = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                              "signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert other.stdout.readline().strip() == "ready"
        scans = iter([[other.pid], [other.pid]])
        monkeypatch.setattr(supervise, "tagged_processes", lambda launch_id: next(scans, []))
        assert supervise.kill_tagged("unit-test-tag", grace_s=0.5) == [other.pid]
        assert other.poll() is None, "a PID that no longer carried the launch id got SIGKILL"
    finally:
        os.kill(other.pid, signal.SIGKILL)
        other.wait()


def test_second_signal_arriving_inside_the_first_handler_still_escalates(monkeypatch):
    """A second SIGTERM can run its handler inside the first one's (CI saw it); it must still mean SIGKILL now."""
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(supervise, "signal_group", lambda pid, sig: sent.append((pid, sig)))

    class Proc:
        pid = 4242

    sup = supervise._Supervisor(Proc(), kill_after_s=60.0)  # type: ignore[arg-type]
    sup._on_signal(signal.SIGTERM, None)
    sup._on_signal(signal.SIGTERM, None)  # before any of the first one's work
    sup._handle_signals()
    assert sent == [(4242, signal.SIGTERM)]
    assert sup.kill_at is not None and sup.kill_at <= time.monotonic()
