"""The main job launched by one ``torchx run`` (local scheduler): a group is killed, heals, and all end identical.

The TorchX component (``ftbridge/launch/torchx.py``) makes the lighthouse and two
replica groups of two ranks; TorchX's ``local_cwd`` scheduler starts them as
its own processes. Group 1's ranks are SIGKILLed by PID once both groups
train together; the group's torchrun restarts them, they heal from group 0,
the stop file ends training, the lighthouse exits once the groups are gone
(``--exit-when-idle-s``), and ``torchx run`` reports ``SUCCEEDED``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from ftbridge.harness.local_job import GroupProcess
from ftbridge.launch.processes import find_free_port_run, pid_alive, signal_group, signal_pids, stop_process_groups
from tests.conftest import TINY

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _children(pid: int) -> list:
    """PIDs whose parent is ``pid`` (from /proc): the roles TorchX's local scheduler started."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", encoding="utf-8") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(name))
            except (OSError, ValueError, IndexError):
                continue
    return out


def _torchx_run(job, port: int) -> subprocess.Popen:
    venv_bin = os.path.dirname(sys.executable)
    env = {**os.environ, "PYTHONPATH": REPO, "PATH": f"{venv_bin}:{os.environ.get('PATH', '')}",
           "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torchx.cli.main", "run", "-s", "local_cwd", "-cfg", f"log_dir={job.workdir}/torchx",
           "ftbridge/launch/torchx.py:job", "--script", "scripts/train_lm.py", "--groups", "2", "--nproc_per_node", "2",
           "--lighthouse_port", str(port), "--lighthouse_heartbeat_timeout_ms", "2000",
           "--lighthouse_idle_exit_s", "1", "--heal_bind", "127.0.0.1",
           "--event_log", f"{job.workdir}/events_{{replica_group}}_{{group_rank}}.jsonl",
           "--env", "FTBRIDGE_CHECKSUM_EVERY=1",
           "--", *TINY, "--steps", "100000", "--stop-file", f"{job.workdir}/stop"]
    log_path = f"{job.workdir}/torchx_run.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    job.groups[0] = [GroupProcess(0, proc, log_path)]  # so job.tails() shows its output
    return proc


def _stop(proc: subprocess.Popen, job) -> None:
    """End torchx run, the roles it started (each in its own session) and every rank, by PID."""
    roles = _children(proc.pid)
    stop_process_groups([proc], grace_s=30)  # on SIGTERM TorchX's handler terminates its roles
    for pid in roles:
        if pid_alive(pid):
            signal_group(pid, signal.SIGKILL)
    signal_pids([p for p in job.all_worker_pids() if pid_alive(p)], signal.SIGKILL)
    job.groups.clear()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchx_local_run_group_killed_heals_and_job_ends_identical(local_job):
    job = local_job(2, 2, [])  # only its event-log readers are used: torchx run starts every process
    proc = _torchx_run(job, find_free_port_run(3))  # the lighthouse, its health (+1) and status (+2)
    try:
        job.wait_until(lambda: any(e["participants"] == 2 and e["committed"] for e in job.steps(1)), 150,
                       "both replica groups to train together")
        kill_time = time.time()
        pids = job.kill_workers(1)
        assert pids and not any(pid_alive(p) for p in pids)
        job.wait_heal(1, kill_time, 120, "group 1, restarted inside its TorchX role, to heal")
        assert proc.poll() is None, "the job ended when one group failed"
        target = job.stop_soon(5)
        assert proc.wait(timeout=120) == 0, job.tails()
        output = job.log_text(0)
        assert "Job finished: SUCCEEDED" in output, job.tails()
        assert "no replica group heartbeated" in output  # the lighthouse role ended on its own
    finally:
        _stop(proc, job)

    # Group 0 never restarted, nor healed after the kill; group 1 restarted once, inside its role, and healed.
    # (At start-up either group may heal once from the other: TorchX starts the roles in no set order, and
    # the first group may commit alone before the second joins, seen once in CI.)
    starts = {g: [e for e in job.events(g, 0) if e.get("event") == "start"] for g in (0, 1)}
    assert len(starts[0]) == 1 and len(starts[1]) == 2
    assert not any(e["healed"] and e["time"] > kill_time for e in job.steps(0))
    assert any(e["healed"] and e["time"] > kill_time for e in job.steps(1))
    finals = [e for e in job.events() if e.get("event") == "final"]
    assert len(finals) == 4 and {f["step"] for f in finals} == {target}, finals
    assert len({f["param_checksum"] for f in finals}) == 1, finals
    for r in (0, 1):
        assert len({f["optimizer_checksum"] for f in finals if f["group_rank"] == r}) == 1, finals
