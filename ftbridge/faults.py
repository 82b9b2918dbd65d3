"""Named fault points: SIGKILL (or freeze) this process at a precise place, for chaos runs and tests.

Code at a place too brief to hit by timing a signal calls :func:`point`, which
does nothing unless the run armed it (one dictionary lookup when
``FTBRIDGE_FAULT_DIR`` is unset). Arming: set ``FTBRIDGE_FAULT_DIR`` (a folder)
for the processes and create ``$FTBRIDGE_FAULT_DIR/<name>`` (:func:`arm`) holding
which process fires: empty (the first to reach it), ``"G"`` (the first rank of
replica group ``G``) or ``"G R"`` (group rank ``R`` of group ``G``), optionally
followed by ``freeze=S`` (SIGSTOP for ``S`` seconds instead of dying). A point
fires **once**: the firing process renames the trigger to ``<name>.fired``
(atomically) and appends its identity and the time.

Points (:data:`POINTS`):

* ``heal_send``: the donor, after sending half of its heal state;
* ``heal_recv``: the joiner, after the heal state's header, before its tensors;
* ``first_quorum``: a launch's first step, once its quorum is decided;
* ``in_allreduce``: a rank in a step's quorum, before the backward of its accumulation boundary
  (the others' all-reduce then has a participant that never sends);
* ``checkpoint_publish``: the checkpoint writer's rank 0, staged and manifest written, before publishing;
* ``in_quorum_call``: a rank whose quorum try is still in flight 5 ms after it went out (for ``freeze=S``).

See docs/chaos.md, "Failure kinds".
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Optional, Tuple

ENV_DIR = "FTBRIDGE_FAULT_DIR"
POINTS = ("heal_send", "heal_recv", "first_quorum", "in_allreduce", "checkpoint_publish", "in_quorum_call")
"""Fault point names that ftbridge's code calls."""


def _identity() -> Tuple[Optional[int], Optional[int]]:
    def num(*names: str) -> Optional[int]:
        for n in names:
            v = os.environ.get(n)
            if v is not None and v.strip().lstrip("-").isdigit():
                return int(v)
        return None
    return num("FTBRIDGE_REPLICA_GROUP_ID", "REPLICA_GROUP_ID"), num("FTBRIDGE_GROUP_RANK", "RANK")


def matches(target: str, group: Optional[int], rank: Optional[int]) -> bool:
    """Whether trigger file content ``target`` selects the process ``group``/``rank``.

    Raises:
        ValueError: ``target`` is not empty, ``"G"`` or ``"G R"`` with integers.
    """
    fields = [f for f in target.split() if not f.startswith("freeze=")]
    if len(fields) > 2 or not all(f.lstrip("-").isdigit() for f in fields):
        raise ValueError(f"fault trigger {target!r}: write '' (any process), 'G' (replica group G) or "
                         "'G R' (group rank R of replica group G)")
    want = [int(f) for f in fields]
    return all(w == have for w, have in zip(want, (group, rank)))


def freeze_seconds(target: str) -> Optional[float]:
    """The ``freeze=S`` of trigger content ``target`` (seconds), or ``None`` when the point kills.

    Raises:
        ValueError: ``S`` is not a positive number.
    """
    for f in target.split():
        if f.startswith("freeze="):
            try:
                seconds = float(f[len("freeze="):])
            except ValueError:
                seconds = -1.0
            if not 0 < seconds < 3600:
                raise ValueError(f"fault trigger {target!r}: freeze=S needs seconds between 0 and 3600")
            return seconds
    return None


def arm(fault_dir: str, name: str, group: Optional[int] = None, rank: Optional[int] = None,
        freeze_s: Optional[float] = None) -> str:
    """Create the trigger for point ``name`` in ``fault_dir`` (atomically); return its path.

    Args:
        freeze_s: freeze the process this long instead of killing it.

    Raises:
        ValueError: ``name`` is not a known point, ``rank`` without ``group``, or ``freeze_s`` not in (0, 3600).
    """
    if name not in POINTS:
        raise ValueError(f"fault point {name!r}: choose one of {', '.join(POINTS)}")
    if rank is not None and group is None:
        raise ValueError("a fault target with a group rank needs its replica group too")
    if freeze_s is not None:
        freeze_seconds(f"freeze={freeze_s}")
    os.makedirs(fault_dir, exist_ok=True)
    path = os.path.join(fault_dir, name)
    tmp = f"{path}.arming"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(" ".join([str(x) for x in (group, rank) if x is not None]
                         + ([f"freeze={freeze_s}"] if freeze_s is not None else [])))
    os.replace(tmp, path)
    return path


def fired(fault_dir: str, name: str) -> bool:
    """Whether point ``name`` has fired in this run."""
    return os.path.exists(os.path.join(fault_dir, f"{name}.fired"))


def armed(name: str) -> bool:
    """Whether point ``name`` is armed for this process (its trigger exists and names it)."""
    fault_dir = os.environ.get(ENV_DIR)
    if not fault_dir:
        return False
    try:
        with open(os.path.join(fault_dir, name), encoding="utf-8") as f:
            target = f.read()
    except OSError:
        return False
    return matches(target, *_identity())


def point(name: str, where: str = "") -> None:
    """Fault point ``name``: SIGKILL (or freeze) this process here if the run armed it for this process.

    Args:
        name: one of :data:`POINTS`.
        where: what the process was doing (a step, a file), for the log line and the ``.fired`` file.
    """
    if not armed(name):
        return
    path = os.path.join(os.environ[ENV_DIR], name)
    try:
        with open(path, encoding="utf-8") as f:
            freeze_s = freeze_seconds(f.read())
    except OSError:
        return
    group, rank = _identity()
    done = f"{path}.fired"
    try:
        os.rename(path, done)            # exactly one process wins
    except OSError:
        return
    with open(done, "a", encoding="utf-8") as f:
        f.write(f"\nreplica_group={group} group_rank={rank} pid={os.getpid()} time={time.time():.3f}"
                f"{' where=' + where if where else ''}\n")
    what = f"freezes itself for {freeze_s:g} s" if freeze_s is not None else "kills itself"
    print(f"FAULT {name}: replica group {group} rank {rank} (pid {os.getpid()}) {what}"
          f"{' ' + where if where else ''}", file=sys.stderr, flush=True)
    if freeze_s is None:
        os.kill(os.getpid(), signal.SIGKILL)
        return
    subprocess.Popen(["/bin/sh", "-c", f"sleep {freeze_s:g}; kill -CONT {os.getpid()}"], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.kill(os.getpid(), signal.SIGSTOP)
