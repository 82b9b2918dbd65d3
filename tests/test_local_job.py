"""LocalJob's PID bookkeeping: a rank's recorded PID is only killed while it is still that rank."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from ftbridge.harness.local_job import _tail_commits, started_by


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


def _write_events(path, records, tail=""):
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
        f.write(tail)
def test_the_last_committed_step_from_the_end_of_the_log(tmp_path):
    p = tmp_path / "events_0_0.jsonl"
    assert _tail_commits(str(p)) == []  # no log yet
    _write_events(p, [{"step": s, "committed": True} for s in range(1, 6)]
           + [{"step": 6, "committed": False}, {"event": "heal", "step": 6}], tail='{"step": 7, "comm')
    assert _tail_commits(str(p))[-1][0] == 5  # a discarded step, another event and a line being written


def test_a_long_log_whose_end_holds_no_commit_is_read_whole(tmp_path):
    p = tmp_path / "events_0_0.jsonl"
    _write_events(p, [{"step": 41, "committed": True}] + [{"event": "noise", "pad": "x" * 200}] * 1000)
    assert p.stat().st_size > 65536 and _tail_commits(str(p))[-1][0] == 41


def test_stop_soon_leads_the_job_by_a_second_of_its_steps_or_the_margin(tmp_path):
    from ftbridge.harness.local_job import LocalJob

    job = LocalJob(str(tmp_path), 2, 1, [])
    fast = [{"step": s, "committed": True, "time": 1000.0 + s / 100} for s in range(1, 101)]  # 100 steps/s
    _write_events(tmp_path / "events_0_0.jsonl", fast)
    _write_events(tmp_path / "events_1_0.jsonl", fast[:-1])  # one step behind
    assert job.max_step() == 100
    assert job.stop_soon() == 200 and (tmp_path / "stop").read_text() == "200"
    slow = [{"step": s, "committed": True, "time": 1000.0 + s} for s in range(1, 11)]  # 1 step/s
    _write_events(tmp_path / "events_0_0.jsonl", slow)
    _write_events(tmp_path / "events_1_0.jsonl", slow)
    assert job.stop_soon() == 13


@pytest.mark.parametrize("log, stepped, relaunched", [
    ("torch.distributed.DistNetworkError: ... code: -98, name: EADDRINUSE, message: address already in use", False,
     True),
    ("RuntimeError: something else", False, False),
    ("... name: EADDRINUSE ...", True, False),
], ids=["port-race", "other-error", "after-a-step"])
def test_a_group_whose_worker_store_lost_its_port_before_its_first_step_is_launched_again_once(
        tmp_path, log, stepped, relaunched):
    from ftbridge.harness.local_job import GroupProcess, LocalJob

    job = LocalJob(str(tmp_path), 1, 1, [])
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    proc.wait(30)
    (tmp_path / "group_0.0.log").write_text(log)
    job.groups[0] = [GroupProcess(0, proc, str(tmp_path / "group_0.0.log"), started=100.0)]
    _write_events(tmp_path / "events_0_0.jsonl", [{"step": 1, "committed": True, "time": 101.0}] if stepped else [])
    started = []

    def start_group(g):
        started.append(g)
        gp = GroupProcess(g, proc, str(tmp_path / "group_0.1.log"))
        job.groups[g].append(gp)
        return gp

    job.start_group = start_group
    job._relaunch_port_races()
    job._relaunch_port_races()  # the relaunch is not relaunched again
    assert started == ([0] if relaunched else [])
