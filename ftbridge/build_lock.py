"""Clear the build lock of DeepSpeed's JIT op that a killed process left behind.

torch builds and loads JIT extensions (DeepSpeed's ``deepspeed_shm_comm`` on
CPU) behind a :class:`torch.utils.file_baton.FileBaton`: the first process
creates ``TORCH_EXTENSIONS_DIR/<op>/lock`` (``O_CREAT | O_EXCL``), runs
ninja (a no-op check once the op is built, still a fraction of a second)
and deletes the file; every other process polls until the file is gone,
without a time limit. A rank SIGKILLed inside that window (a node failure,
the OOM killer, a chaos test) leaves the file forever, and every later
DeepSpeed start in that environment hangs in ``deepspeed.init_distributed``,
the restarted group included. Seen on this project's machines: a lock left
at 15:50 held every DeepSpeed start of the environment until removed by hand.

The holder keeps the lock file open until it deletes it, so a lock file that
no process has open is stale. :func:`clear_stale_build_locks` (run when
ftbridge is imported, before any DeepSpeed op loads) removes such files,
with a warning naming each. Linux only (``/proc``); it sees the processes of
this user, as the lock's holder normally is.
"""

from __future__ import annotations

import logging
import os
from typing import List, Set

logger = logging.getLogger("ftbridge.build_lock")


def _open_paths(proc: str = "/proc") -> Set[str]:
    """Real paths of every file some readable process has open (``/proc/<pid>/fd``)."""
    held: Set[str] = set()
    try:
        pids = [p for p in os.listdir(proc) if p.isdigit()]
    except OSError:
        return held
    for pid in pids:
        fd_dir = os.path.join(proc, pid, "fd")
        try:
            fds = os.listdir(fd_dir)
        except OSError:  # gone, or another user's
            continue
        for fd in fds:
            try:
                held.add(os.readlink(os.path.join(fd_dir, fd)))
            except OSError:
                continue
    return held


def clear_stale_build_locks(extensions_dir: str, proc: str = "/proc") -> List[str]:
    """Remove ``<extensions_dir>/<op>/lock`` files that no process has open.

    Args:
        extensions_dir: torch's ``TORCH_EXTENSIONS_DIR``.
        proc: the proc file system (tests pass another).

    Returns:
        The lock files removed (absolute paths); empty when there was none,
        or ``/proc`` is not readable (nothing is removed then).
    """
    try:
        locks = [os.path.join(extensions_dir, d, "lock") for d in os.listdir(extensions_dir)]
    except OSError:
        return []
    locks = [os.path.realpath(p) for p in locks if os.path.isfile(p) and not os.path.islink(p)]
    if not locks or not os.path.isdir(os.path.join(proc, "self", "fd")):
        return []
    held = _open_paths(proc)
    removed = []
    for lock in locks:
        if lock in held:
            continue
        try:
            os.remove(lock)
        except FileNotFoundError:  # released meanwhile
            continue
        except OSError as e:
            logger.warning("cannot remove the stale JIT build lock %s (%s): DeepSpeed's start will wait for it; "
                           "delete it by hand", lock, e)
            continue
        removed.append(lock)
        logger.warning("removed %s: no process holds it (a process killed while building or checking a "
                       "DeepSpeed op left it, and every DeepSpeed start would wait for it forever)", lock)
    return removed
