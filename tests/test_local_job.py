"""LocalJob's PID bookkeeping: a rank's recorded PID is only killed while it is still that rank."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from ftbridge.harness.local_job import started_by


@pytest.mark.timeout(30)
def test_started_by_tells_a_recorded_rank_from_a_later_process_with_its_pid():
    before = time.time() - 5  # a start event written before this process existed: its PID was reused
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        after = time.time()
        assert started_by(proc.pid, after), "the process that wrote its start event after starting"
        assert not started_by(proc.pid, before), "a process that started after the event is another one"
    finally:
        proc.kill()
        proc.wait()
    assert not started_by(proc.pid, after), "a PID that is gone"
