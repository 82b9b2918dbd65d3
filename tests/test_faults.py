"""Named fault points: targeting, arming, and firing exactly once (a real SIGKILL of a real process)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from ftbridge import faults

FIRE = "from ftbridge import faults; faults.point('in_allreduce', 'after joining the quorum of step 7'); print('alive')"


@pytest.mark.parametrize("target, group, rank, hit", [
    ("", 3, 1, True), ("3", 3, 1, True), ("3", 2, 1, False), ("3 1", 3, 1, True), ("3 0", 3, 1, False),
    ("3 1", None, None, False),
])
def test_a_trigger_selects_its_group_and_rank(target, group, rank, hit):
    assert faults.matches(target, group, rank) is hit


@pytest.mark.parametrize("target", ["x", "1 2 3", "1.5"])
def test_a_malformed_trigger_is_refused(target):
    with pytest.raises(ValueError, match="fault trigger"):
        faults.matches(target, 0, 0)


def test_arming_an_unknown_point_or_a_rank_without_group_is_refused(tmp_path):
    with pytest.raises(ValueError, match="choose one of"):
        faults.arm(str(tmp_path), "nowhere")
    with pytest.raises(ValueError, match="needs its replica group"):
        faults.arm(str(tmp_path), "in_allreduce", rank=0)


def _run(tmp_path, group: int, rank: int) -> subprocess.CompletedProcess:
    env = {**os.environ, faults.ENV_DIR: str(tmp_path), "FTBRIDGE_REPLICA_GROUP_ID": str(group),
           "FTBRIDGE_GROUP_RANK": str(rank)}
    return subprocess.run([sys.executable, "-c", FIRE], env=env, capture_output=True, text=True, timeout=60,
                          check=False)


@pytest.mark.timeout(120)
def test_an_armed_point_kills_its_target_once_and_no_other(tmp_path):
    faults.arm(str(tmp_path), "in_allreduce", group=1, rank=0)
    other = _run(tmp_path, 1, 1)
    assert other.returncode == 0 and "alive" in other.stdout and not faults.fired(str(tmp_path), "in_allreduce")
    target = _run(tmp_path, 1, 0)
    assert target.returncode == -signal.SIGKILL, target
    assert "FAULT in_allreduce: replica group 1 rank 0" in target.stderr
    assert "after joining the quorum of step 7" in target.stderr
    fired = (tmp_path / "in_allreduce.fired").read_text()
    assert "replica_group=1 group_rank=0" in fired and "where=after joining the quorum of step 7" in fired
    again = _run(tmp_path, 1, 0)  # a restarted process reaches the point again: it has fired
    assert again.returncode == 0 and "alive" in again.stdout


@pytest.mark.parametrize("target, seconds", [("1 0 freeze=7", 7.0), ("freeze=0.5", 0.5), ("1", None)])
def test_a_trigger_may_freeze_instead_of_kill(target, seconds):
    assert faults.freeze_seconds(target) == seconds
    assert faults.matches(target, 1, 0)


@pytest.mark.parametrize("target", ["1 freeze=0", "1 freeze=x", "freeze=-2"])
def test_a_malformed_freeze_is_refused(target):
    with pytest.raises(ValueError, match="freeze=S"):
        faults.freeze_seconds(target)


FREEZE = "from ftbridge import faults; faults.point('in_quorum_call', 'quorum call 3'); print('alive')"


@pytest.mark.timeout(120)
def test_an_armed_freeze_stops_its_target_then_it_goes_on(tmp_path):
    faults.arm(str(tmp_path), "in_quorum_call", group=0, rank=1, freeze_s=3)
    env = {**os.environ, faults.ENV_DIR: str(tmp_path), "FTBRIDGE_REPLICA_GROUP_ID": "0", "FTBRIDGE_GROUP_RANK": "1"}
    proc = subprocess.Popen([sys.executable, "-c", FREEZE], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        states = set()
        while proc.poll() is None and "T" not in states:  # bounded by the test's timeout
            with open(f"/proc/{proc.pid}/stat", encoding="ascii") as f:
                states.add(f.read().rsplit(")", 1)[1].split()[0])
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "T" in states and proc.returncode == 0 and "alive" in out, (states, out, err)
    assert "freezes itself for 3 s quorum call 3" in err and faults.fired(str(tmp_path), "in_quorum_call")
