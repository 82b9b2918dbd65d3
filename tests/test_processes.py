"""ftbridge/launch/processes.py: torchrun's command line and environment, and stopping whole process groups."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from ftbridge.launch.processes import TORCHRUN, pid_alive, stop_process_groups, torchrun_command


def test_local_command_picks_a_free_rendezvous_port_and_leaves_unset_flags_out():
    argv, env = torchrun_command("train.py", ["--steps", "3"], nproc_per_node=2, environ={})
    assert argv[:3] == list(TORCHRUN) and argv[-3:] == ["train.py", "--steps", "3"]
    flags = dict(zip(argv[3:-3:2], argv[4:-3:2]))
    port = int(flags["--rdzv-endpoint"].split(":")[1])
    assert flags == {"--nproc-per-node": "2", "--rdzv-backend": "c10d",
                     "--rdzv-endpoint": f"127.0.0.1:{port}", "--rdzv-id": f"local{port}"}
    assert env == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"}


def test_the_callers_environment_wins_except_the_shared_rendezvous_store():
    argv, env = torchrun_command("w.py", nproc_per_node=1, rdzv_endpoint="node3:29400", rdzv_id="g1",
                                 nnodes="1:2", node_rank=1, max_restarts=0,
                                 environ={"OMP_NUM_THREADS": "4", "RUST_LOG": "info",
                                          "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0", "X": "y"})
    assert argv == [*TORCHRUN, "--nnodes", "1:2", "--nproc-per-node", "1", "--node-rank", "1",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", "node3:29400", "--rdzv-id", "g1",
                    "--max-restarts", "0", "w.py"]
    assert env == {"OMP_NUM_THREADS": "4", "RUST_LOG": "info", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "X": "y"}


def test_no_ranks_is_refused():
    with pytest.raises(ValueError, match="nproc_per_node=0"):
        torchrun_command("w.py", nproc_per_node=0)


# A group leader that ignores SIGTERM and starts a child (same group) that ignores it too; prints the child's pid.
_STUBBORN = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
             "c = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
             "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(60)'], "
             "stdout=subprocess.PIPE); c.stdout.readline(); print(c.pid, flush=True); time.sleep(60)")


@pytest.mark.timeout(60)
def test_stop_escalates_to_sigkill_for_the_whole_group_and_reaps_an_exited_one():
    stubborn = subprocess.Popen([sys.executable, "-c", _STUBBORN], stdout=subprocess.PIPE, text=True,
                                start_new_session=True)
    done = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    child = int(stubborn.stdout.readline())
    try:
        done.wait(timeout=30)
        t = time.monotonic()
        codes = stop_process_groups([stubborn, done], grace_s=0.5)
        assert codes == [-signal.SIGKILL, 0] and time.monotonic() - t < 10
        deadline = time.monotonic() + 10  # the child is reparented to init, which reaps it
        while pid_alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pid_alive(child), "the leader's child outlived the group's SIGKILL"
    finally:
        for pid in (stubborn.pid, child):
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        stubborn.stdout.close()


@pytest.mark.timeout(60)
def test_stop_ends_a_group_that_honours_sigterm_without_sigkill():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        assert stop_process_groups([proc], grace_s=30) == [-signal.SIGTERM]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_free_port_run_lies_below_the_ephemeral_range_and_is_bindable():
    import socket

    from ftbridge.launch.processes import ephemeral_port_range, find_free_port_run

    first = find_free_port_run(3, host="127.0.0.1", seed=1)
    assert 10000 <= first and first + 2 < ephemeral_port_range()[0]
    socks = [socket.socket() for _ in range(3)]
    try:
        for i, s in enumerate(socks):
            s.bind(("127.0.0.1", first + i))
    finally:
        for s in socks:
            s.close()
    held = socket.socket()
    held.bind(("127.0.0.1", first + 1))  # the run it found is taken now: another seed-1 draw must skip it
    try:
        assert find_free_port_run(3, host="127.0.0.1", seed=1) != first
    finally:
        held.close()
