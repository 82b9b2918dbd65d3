"""ftbridge.launch.build_lock: a JIT build lock no process holds is removed; a held one is kept."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from ftbridge.launch.build_lock import clear_stale_build_locks, watch_build_locks


def _lock(root, op):
    d = root / op
    d.mkdir()
    path = d / "lock"
    fd = os.open(path, os.O_CREAT | os.O_EXCL)  # as torch's FileBaton creates it
    return str(path), fd


def test_a_lock_left_by_a_killed_process_is_removed_and_a_held_one_kept(tmp_path):
    stale, fd = _lock(tmp_path, "deepspeed_shm_comm")
    os.close(fd)  # its holder is gone
    held, held_fd = _lock(tmp_path, "other_op")
    try:
        assert clear_stale_build_locks(str(tmp_path), confirm_s=0) == [os.path.realpath(stale)]
        assert not os.path.exists(stale) and os.path.exists(held)
    finally:
        os.close(held_fd)


def test_a_lock_held_by_another_live_process_is_kept(tmp_path):
    path, fd = _lock(tmp_path, "deepspeed_shm_comm")
    os.close(fd)
    holder = subprocess.Popen([sys.executable, "-c", f"f = open({path!r}); print('ok', flush=True); input()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ok"
        assert clear_stale_build_locks(str(tmp_path), confirm_s=0) == [] and os.path.exists(path)
    finally:
        holder.kill()
        holder.wait(timeout=10)
    assert clear_stale_build_locks(str(tmp_path), confirm_s=0) != [] and not os.path.exists(path)


def test_nothing_to_do_without_locks_or_folder(tmp_path):
    assert clear_stale_build_locks(str(tmp_path / "missing"), confirm_s=0) == []
    (tmp_path / "op").mkdir()
    assert clear_stale_build_locks(str(tmp_path), confirm_s=0) == []


def test_a_lock_released_and_taken_again_between_the_scans_is_kept(tmp_path):
    # A holder closes the file a moment before it deletes it: unheld in one scan proves nothing.
    path, fd = _lock(tmp_path, "deepspeed_shm_comm")
    os.close(fd)
    new_fd: list = []

    def retaken(_s):
        os.remove(path)
        new_fd.append(os.open(path, os.O_CREAT | os.O_EXCL))  # the next holder, same name, new file
        os.close(new_fd[0])  # and let it look unheld again: only its identity differs
    assert clear_stale_build_locks(str(tmp_path), sleep=retaken) == []
    assert os.path.exists(path)


def test_the_watch_clears_a_lock_that_goes_stale_after_it_started(tmp_path):
    thread = watch_build_locks(str(tmp_path), interval_s=0.02, duration_s=30)
    path, fd = _lock(tmp_path, "deepspeed_shm_comm")  # held while the watch runs
    os.close(fd)  # the holder dies
    deadline = time.monotonic() + 20
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)  # polling an outcome with a deadline, not synchronising on time
    assert not os.path.exists(path)
    assert thread.daemon and thread.name == "ftbridge-build-lock"
