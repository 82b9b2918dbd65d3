"""Supervising torchrun for ``ftbridge-run``: signals forwarded, escalation, nothing left behind.

:func:`run_torchrun` starts torchrun in its own session with a parent-death
signal (it gets SIGTERM if the launcher dies), forwards the launcher's
SIGTERM/SIGINT/SIGHUP to torchrun's process group, escalates to SIGKILL after
the ranks' shutdown timeout plus :data:`KILL_AFTER_SHUTDOWN_S` (at once on a
second signal), and finally ends every process still tagged with the launch's
``FTBRIDGE_LAUNCH_ID`` (ranks torchrun left behind, found through
``/proc/<pid>/environ`` on Linux).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Callable, Mapping, Optional, Sequence

from ftbridge.launch.processes import pid_alive, signal_group, signal_pids, stop_process_groups

log = logging.getLogger("ftbridge.launch.run")  # the launcher's own lines, under its name and format

LAUNCH_ID_ENV = "FTBRIDGE_LAUNCH_ID"
"""The environment variable that tags every process of one launch (a UUID per ``ftbridge-run``)."""
KILL_AFTER_SHUTDOWN_S = 5.0
"""Extra time torchrun gets, beyond its ranks' shutdown timeout, before SIGKILL (s)."""
STRAGGLER_GRACE_S = 3.0
"""Time between SIGTERM and SIGKILL for processes left behind by torchrun (s)."""

_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if sys.platform.startswith("linux") else None


def _child_preexec(parent_pid: int) -> Callable[[], None]:
    """Runs in torchrun's process before exec: SIGTERM it when the launcher dies."""
    def preexec() -> None:
        if _LIBC is not None:
            _LIBC.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent_pid:  # the launcher died before prctl took effect
            os._exit(1)
    return preexec


def tagged_processes(launch_id: str) -> list[int]:
    """PIDs of live processes whose environment holds ``FTBRIDGE_LAUNCH_ID=launch_id`` (Linux)."""
    marker = f"{LAUNCH_ID_ENV}={launch_id}".encode()
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def kill_tagged(launch_id: str, grace_s: float = STRAGGLER_GRACE_S) -> list[int]:
    """End every process tagged with ``launch_id``: SIGTERM, then SIGKILL after ``grace_s`` (s).

    Returns:
        The PIDs that were still running and got a signal.
    """
    pids = tagged_processes(launch_id)
    if not pids:
        return []
    log.warning("ending %d process(es) torchrun left behind: %s", len(pids), pids)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        # Tagged again before each signal: a PID that ended after SIGTERM can belong to another process
        # by now (pid_max is 32768 here, and every thread takes a number), which must not get SIGKILL.
        signal_pids([p for p in tagged_processes(launch_id) if p in pids], sig)
        deadline = time.monotonic() + grace_s
        while (any(pid_alive(p) for p in pids) and set(tagged_processes(launch_id)) & set(pids)
               and time.monotonic() < deadline):
            time.sleep(0.05)
    return pids


class _Supervisor:
    """Forwards signals to torchrun's process group and escalates to SIGKILL."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

    def __init__(self, proc: subprocess.Popen, kill_after_s: float) -> None:
        self.proc = proc
        self.kill_after_s = kill_after_s
        self.kill_at: Optional[float] = None
        self._previous: dict[int, object] = {}
        # The handler only appends (one C call): a second signal can run its
        # handler inside the first one's, so all decisions are made in wait().
        self._received: list[int] = []
        self._handled = 0

    def __enter__(self) -> "_Supervisor":
        try:
            self._previous = {s: signal.signal(s, self._on_signal) for s in self.SIGNALS}
        except ValueError:  # not the main thread: the caller handles signals
            log.debug("not in the main thread; signals are not forwarded")
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._received.append(signum)

    def _handle_signals(self) -> None:
        """Act on the signals received since the last call: forward the first, escalate on any later one."""
        while self._handled < len(self._received):
            signum = self._received[self._handled]
            self._handled += 1
            name = signal.Signals(signum).name
            if self.kill_at is None:
                self.kill_at = time.monotonic() + self.kill_after_s
                log.warning("got %s; forwarding it to torchrun (pid %d), SIGKILL in %.0f s",
                            name, self.proc.pid, self.kill_after_s)
                signal_group(self.proc.pid, signum)
            else:
                self.kill_at = time.monotonic()
                log.warning("got %s again; SIGKILL to torchrun now", name)

    def wait(self) -> int:
        while True:
            self._handle_signals()
            if self.kill_at is not None and time.monotonic() >= self.kill_at:
                signal_group(self.proc.pid, signal.SIGKILL)
            try:
                return self.proc.wait(timeout=0.1)
            except subprocess.TimeoutExpired:
                pass


def run_torchrun(argv: Sequence[str], env: Mapping[str, str], *, shutdown_timeout_s: float = 10.0) -> int:
    """Run torchrun until it exits, forwarding signals, and leave no process behind.

    Args:
        argv, env: from :func:`build_torchrun_command` (``env`` must hold
            ``FTBRIDGE_LAUNCH_ID``).
        shutdown_timeout_s: the ranks' SIGTERM-to-SIGKILL time (s); torchrun
            itself is SIGKILLed ``KILL_AFTER_SHUTDOWN_S`` later.

    Returns:
        torchrun's exit code, or 128+N if it died of signal N.
    """
    kill_after_s = shutdown_timeout_s + KILL_AFTER_SHUTDOWN_S
    proc = subprocess.Popen(list(argv), env=dict(env), start_new_session=True,
                            preexec_fn=_child_preexec(os.getpid()))  # noqa: PLW1509 - prctl only, no locks
    log.info("torchrun pid %d", proc.pid)
    try:
        with _Supervisor(proc, kill_after_s) as sup:
            rc = sup.wait()
    finally:
        stop_process_groups([proc], grace_s=kill_after_s, kill_wait_s=None)  # signals it only if the launcher raised
        kill_tagged(env[LAUNCH_ID_ENV])
    code = 128 - rc if rc < 0 else rc
    log.log(logging.INFO if code == 0 else logging.WARNING, "torchrun exited with code %d", code)
    return code
