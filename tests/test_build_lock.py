"""ftbridge.build_lock: a JIT build lock no process holds is removed; a held one is kept."""

from __future__ import annotations

import os
import subprocess
import sys

from ftbridge.build_lock import clear_stale_build_locks


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
        assert clear_stale_build_locks(str(tmp_path)) == [os.path.realpath(stale)]
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
        assert clear_stale_build_locks(str(tmp_path)) == [] and os.path.exists(path)
    finally:
        holder.kill()
        holder.wait(timeout=10)
    assert clear_stale_build_locks(str(tmp_path)) != [] and not os.path.exists(path)


def test_nothing_to_do_without_locks_or_folder(tmp_path):
    assert clear_stale_build_locks(str(tmp_path / "missing")) == []
    (tmp_path / "op").mkdir()
    assert clear_stale_build_locks(str(tmp_path)) == []
