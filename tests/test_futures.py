"""Bounded calls in helper threads (ftbridge.manager.futures): the exit wait that keeps a rank's own exit status."""

import subprocess
import sys
import threading
from datetime import timedelta

import pytest

from ftbridge.manager import futures

pytestmark = pytest.mark.timeout(120)

# A wait on a TCPStore key nobody sets (1 s) is left behind; the main thread exits with status 3 while a slow
# teardown keeps the interpreter finalizing as the wait returns.
LEFT_BEHIND = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
from ftbridge.manager import futures
futures.EXIT_WAIT_S = float(sys.argv[1])
server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
client = dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False)
futures.in_thread(lambda: client.wait(["never-set"], timedelta(seconds=1)), "left-behind")
time.sleep(0.2)

class SlowTeardown:
    def __del__(self):
        time.sleep(2.0)

keep = SlowTeardown()
sys.exit(3)
"""


def test_a_rank_exiting_while_a_store_call_it_left_behind_still_runs_exits_with_its_own_status():
    """Without the exit wait, the call's thread returning during finalization can abort the process (SIGABRT,
    "terminate called without an active exception"), as ranks leaving as duplicate group ids did in chaos runs;
    ``EXIT_WAIT_S = 0`` here aborts in some runs, depending on when the interpreter's teardown reaches it."""
    out = subprocess.run([sys.executable, "-c", LEFT_BEHIND, str(futures.EXIT_WAIT_S)], check=False,
                         capture_output=True, text=True, timeout=90)
    assert out.returncode == 3, out.stderr[-3000:]
    assert "terminate called" not in out.stderr


def test_wait_at_exit_waits_for_running_calls_and_counts_the_ones_past_its_bound():
    assert futures.wait_at_exit(0.0) == 0
    release = threading.Event()
    f = futures.in_thread(lambda: release.wait(30), "blocked")
    assert futures.wait_at_exit(0.05) == 1
    release.set()
    assert f.result(timeout=10) is True
    assert futures.wait_at_exit(5.0) == 0


def test_call_bounded_raises_timeout_naming_what_did_not_answer():
    release = threading.Event()
    with pytest.raises(TimeoutError, match="the test's store did not answer within 0.05 s"):
        futures.call_bounded(lambda: release.wait(30), timedelta(milliseconds=50), "the test's store")
    release.set()
