"""DeepSpeed's JIT-built op: this environment's cache, one ninja, and the lock a killed process left behind.

:func:`prepare_jit_build`, called by every ftbridge entry point before DeepSpeed may build or load its op
(``import ftbridge`` changes nothing), gives the process and its children their own ``TORCH_EXTENSIONS_DIR`` and
this environment's ``ninja`` (two ninja versions read each other's build log as changed and rebuild the op), and
clears stale build locks: the holder of ``TORCH_EXTENSIONS_DIR/<op>/lock`` (torch's ``FileBaton``) keeps it open
until it deletes it, so a lock no process has open was left by a killed one, and every later start would wait
for it forever. Linux only (``/proc``; this user's processes). Symptoms and fixes: docs/troubleshooting.md.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import sys
import threading
import time
from typing import Callable, Dict, List, Set, Tuple

logger = logging.getLogger("ftbridge.launch.build_lock")


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


def _unheld(locks: List[str], proc: str) -> Dict[str, Tuple[int, int]]:
    """The lock files of ``locks`` that exist and no process has open, with their (inode, mtime in ns)."""
    held = _open_paths(proc)
    out: Dict[str, Tuple[int, int]] = {}
    for lock in locks:
        if lock in held:
            continue
        try:
            st = os.lstat(lock)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            out[lock] = (st.st_ino, st.st_mtime_ns)
    return out


def clear_stale_build_locks(extensions_dir: str, proc: str = "/proc", confirm_s: float = 0.5,
                            sleep: Callable[[float], None] = time.sleep) -> List[str]:
    """Remove ``<extensions_dir>/<op>/lock`` files that no process has open.

    Stale means unheld in two scans ``confirm_s`` apart and the same file (inode, mtime) in both: a holder
    closes the file a moment before deleting it, and its delete must not fail.

    Args:
        extensions_dir: torch's ``TORCH_EXTENSIONS_DIR``.
        proc: the proc file system (tests pass another).
        confirm_s: seconds between the two scans (only spent when a lock looks stale).
        sleep: how to wait between the scans (tests pass their own).

    Returns:
        The lock files removed (absolute paths); empty when none, or when ``/proc`` is not readable.
    """
    try:
        locks = [os.path.realpath(os.path.join(extensions_dir, d, "lock")) for d in os.listdir(extensions_dir)]
    except OSError:
        return []
    locks = [p for p in locks if os.path.isfile(p)]
    if not locks or not os.path.isdir(os.path.join(proc, "self", "fd")):
        return []
    first = _unheld(locks, proc)
    if not first:
        return []
    sleep(confirm_s)
    second = _unheld(list(first), proc)
    removed = []
    for lock, ident in second.items():
        if first.get(lock) != ident:  # released and taken again meanwhile
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


def watch_build_locks(extensions_dir: str, interval_s: float = 2.0, duration_s: float = 600.0,
                      proc: str = "/proc") -> threading.Thread:
    """Run :func:`clear_stale_build_locks` every ``interval_s`` for ``duration_s`` in a daemon thread.

    Covers a start already waiting when the holder dies; ``duration_s`` should span DeepSpeed's start-up.

    Returns:
        The started thread (``ftbridge-build-lock``).
    """
    def run() -> None:
        deadline = time.monotonic() + duration_s
        while time.monotonic() < deadline:
            try:
                clear_stale_build_locks(extensions_dir, proc)
            except Exception as e:  # noqa: BLE001 - a watchdog must never take the process down
                logger.debug("build lock watch: %s", e)
            time.sleep(interval_s)

    thread = threading.Thread(target=run, name="ftbridge-build-lock", daemon=True)
    thread.start()
    return thread


_watched: Set[str] = set()
"""Extensions directories this process already cleared and watches."""


def prepare_jit_build() -> str:
    """Set up this process, and the processes it starts, for DeepSpeed's JIT-built op (idempotent).

    Sets ``TORCH_EXTENSIONS_DIR`` to ``<sys.prefix>/torch_extensions`` unless set, puts this environment's
    ``ninja`` first on ``PATH`` when it has one, and, once per process, clears and watches stale build locks.

    Returns:
        The extensions directory.
    """
    ext = os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
    ninja = os.path.join(os.path.dirname(sys.executable), "ninja")
    if os.path.exists(ninja) and shutil.which("ninja") != ninja:
        os.environ["PATH"] = os.path.dirname(ninja) + os.pathsep + os.environ.get("PATH", "")
    if ext not in _watched:
        _watched.add(ext)
        clear_stale_build_locks(ext)
        watch_build_locks(ext)
    return ext
