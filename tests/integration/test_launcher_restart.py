"""ftbridge-run end to end: repeated in-group restarts, and no process left after a signal.

Each test starts ``python -m ftbridge.launch.run`` on
``workers/restart_worker.py`` (2 gloo ranks), with its own output folder,
a free rendezvous port chosen by the launcher, and a lighthouse address that
nothing listens on (these workers never call it).
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ftbridge.launch.processes import pid_alive

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "integration" / "workers" / "restart_worker.py"


class Launch:
    """One ``ftbridge-run`` subprocess; stdout and stderr lines are kept and queued."""

    def __init__(self, out: Path, mode: str, *flags: str) -> None:
        cmd = [sys.executable, "-m", "ftbridge.launch.run", "--replica-group-id", "0",
               "--num-replica-groups", "1", "--nproc-per-node", "2", "--lighthouse", "http://127.0.0.1:9",
               "--no-lighthouse-check",
               "--shutdown-timeout-s", "5", *flags, "--", str(WORKER), str(out), mode]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue = queue.Queue()
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self._threads = [threading.Thread(target=self._drain, args=(self.proc.stdout, self.stdout), daemon=True),
                         threading.Thread(target=self._drain, args=(self.proc.stderr, self.stderr), daemon=True)]
        for t in self._threads:
            t.start()

    def _drain(self, stream, keep: list) -> None:
        for line in stream:
            keep.append(line)
            self.lines.put(line)

    def output(self) -> str:
        for t in self._threads:
            t.join(timeout=5)
        return "--- stdout ---\n" + "".join(self.stdout) + "--- stderr ---\n" + "".join(self.stderr)

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"ftbridge-run still running after {timeout_s} s\n{self.output()}")

    def wait_for_matches(self, pattern: str, count: int, timeout_s: float) -> list[str]:
        """First group of the next ``count`` matches of ``pattern`` in output lines."""
        found: list[str] = []
        deadline = time.monotonic() + timeout_s
        while len(found) < count:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"{len(found)}/{count} matches of {pattern!r} within {timeout_s} s\n"
                            f"{self.output()}")
            found += re.findall(pattern, line)
        return found[:count]

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _pids(out: Path, prefix: str) -> list[int]:
    return [int(p.read_text()) for p in sorted(out.glob(f"{prefix}*"))]


def _kill_leftovers(pids: list[int]) -> None:
    for pid in pids:
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(120)
def test_group_restarts_twice_after_sigkill_and_then_succeeds(tmp_path):
    launch = Launch(tmp_path, "restart", "--max-restarts", "2")
    try:
        rc = launch.wait(timeout_s=100)
        log = launch.output()
        assert rc == 0, log
        # Attempts 0 and 1: rank 1 reached the all-reduce, then SIGKILL really ended it.
        for attempt in (0, 1):
            killed = int((tmp_path / f"killing-{attempt}-1").read_text())
            assert not (tmp_path / f"survived-{attempt}-1").exists(), log
            assert not pid_alive(killed)
            assert re.search(rf"exitcode: -9\)? local_rank: 1 \(pid: {killed}\)", log), log
            assert not (tmp_path / f"rank0-passed-barrier-{attempt}").exists(), log
        # Attempt 2 (the third rendezvous of the same group): a correct all-reduce on both ranks.
        expected = (1 + 2) * (2 + 1)  # sum over ranks of (rank + 1) * (attempt + 1)
        for rank in (0, 1):
            assert float((tmp_path / f"result-2-{rank}").read_text()) == expected
            assert (tmp_path / f"done-{rank}").read_text() == "ok"
        assert not list(tmp_path.glob("pid-3-*")), "a fourth attempt ran"
        # Every rank of every attempt is gone.
        assert not [p for p in _pids(tmp_path, "pid-") if pid_alive(p)]
        assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in log and "--rdzv-backend c10d" in log
    finally:
        launch.kill()
        _kill_leftovers(_pids(tmp_path, "pid-"))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_to_launcher_leaves_no_process(tmp_path, sig):
    launch = Launch(tmp_path, "hang")
    pids: list[int] = []
    try:
        pids += [int(p) for p in launch.wait_for_matches(r"READY rank \d pid (\d+)", 2, timeout_s=60)]
        pids.append(int(re.search(r"torchrun pid (\d+)", "".join(launch.stderr)).group(1)))
        assert all(pid_alive(p) for p in pids)
        launch.proc.send_signal(sig)
        rc = launch.wait(timeout_s=40)
        log = launch.output()
        assert rc != 0, log
        assert f"got {sig.name}; forwarding it to torchrun" in log
        left = [p for p in pids if pid_alive(p)]
        assert not left, f"still alive after {sig.name}: {left}\n{log}"
    finally:
        launch.kill()
        _kill_leftovers(pids)


@pytest.mark.timeout(90)
def test_sigkilled_launcher_takes_torchrun_and_ranks_down(tmp_path):
    """PR_SET_PDEATHSIG: torchrun gets SIGTERM when the launcher dies, and stops its ranks."""
    launch = Launch(tmp_path, "hang")
    pids: list[int] = []
    try:
        pids += [int(p) for p in launch.wait_for_matches(r"READY rank \d pid (\d+)", 2, timeout_s=60)]
        pids.append(int(re.search(r"torchrun pid (\d+)", "".join(launch.stderr)).group(1)))
        launch.kill()
        deadline = time.monotonic() + 30  # torchrun gives ranks --shutdown-timeout-s 5 after SIGTERM
        while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)  # waiting on processes owned by another parent: nothing to block on
        left = [p for p in pids if pid_alive(p)]
        assert not left, f"still alive after SIGKILL of the launcher: {left}\n{launch.output()}"
    finally:
        launch.kill()
        _kill_leftovers(pids)


@pytest.mark.timeout(90)
def test_second_signal_kills_torchrun_and_the_launcher_ends_its_orphans(tmp_path):
    """Ranks that ignore SIGTERM, torchrun SIGKILLed: the launcher still ends every rank it started."""
    launch = Launch(tmp_path, "stubborn", "--shutdown-timeout-s", "60")
    pids: list[int] = []
    try:
        pids += [int(p) for p in launch.wait_for_matches(r"READY rank \d pid (\d+)", 2, timeout_s=60)]
        torchrun = int(re.search(r"torchrun pid (\d+)", "".join(launch.stderr)).group(1))
        launch.proc.send_signal(signal.SIGTERM)
        launch.wait_for_matches(r"(got SIGTERM); forwarding", 1, timeout_s=10)
        launch.proc.send_signal(signal.SIGTERM)
        rc = launch.wait(timeout_s=30)
        log = launch.output()
        assert rc == 128 + signal.SIGKILL, log  # torchrun's fate
        assert "got SIGTERM again; SIGKILL to torchrun now" in log
        assert "ending 2 process(es) torchrun left behind" in log
        left = [p for p in [*pids, torchrun] if pid_alive(p)]
        assert not left, f"still alive: {left}\n{log}"
    finally:
        launch.kill()
        _kill_leftovers(pids)
