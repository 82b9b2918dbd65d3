"""Injecting one failure into a running :class:`~ftbridge.harness.local_job.LocalJob`.

Each ``inject_*`` function does the failure, waits until it has really
happened (a killed process is gone, a fault point has fired), and returns an
:class:`Injected` record: when, whom it hit, and what to wait for before the
job counts as recovered. The chaos runner (:mod:`ftbridge.harness.chaos.runner`)
does the waiting and the measuring.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set

from ftbridge import faults
from ftbridge.harness.chaos.schedule import Failure, FailureKind
from ftbridge.harness.chaos.spares import SCALE_DOWN_WITH_SPARES
from ftbridge.harness.local_job import LocalJob
from ftbridge.launch.processes import pid_alive, signal_pids

_TAKE_A_GROUP_OUT = {FailureKind.KILL_RANK, FailureKind.KILL_GROUP, FailureKind.HANG,
                     FailureKind.KILL_JOINER_IN_HEAL, FailureKind.KILL_DONOR_IN_HEAL, FailureKind.KILL_IN_CHECKPOINT,
                     FailureKind.PARTITION_LIGHTHOUSE, FailureKind.LOSSY_LINK, FailureKind.PARTITION_PEER}
"""Kinds that take a group out of the job for a while: another group with state must be running."""
HOLDER_WAIT_S = 2.0
"""Longest wait (s) for another running group to log the job's newest committed step before a kill counts as
taking the last holder of the job's newest state (:meth:`Injector._keep_a_holder`)."""
DONOR_SYNC_S = 15.0
"""Longest wait (s), after a donor kill's first kill, for the other running groups to commit together again
before the donor's fault point is armed (:meth:`Injector._arm_donor`)."""
SLOW_PERIOD_S = 0.2
"""A slowed group's ranks are stopped for the first half of every period of this length."""


class _NoTarget(Exception):
    """The failure drawn has nothing running to hit; it is skipped, with this reason."""


@dataclass
class Injected:
    """What one injected failure did.

    Attributes:
        failure: the scheduled failure.
        time: when it took effect (seconds since the epoch).
        hit: replica groups it took out (they must heal to rejoin).
        rejoin: groups expected to heal back into the job afterwards.
        target: human-readable target, e.g. ``"group 1 rank 0 (pid 123)"``.
        skipped: why it was not injected ("" if it was).
        ended: when a failure with a duration ended (the lighthouse back up),
            seconds since the epoch; recovery is measured from here. None otherwise.
        heal_optional: the ``rejoin`` groups kept their state (a hang): they
            must heal only if the others committed steps without them, and
            otherwise rejoin by committing with them again.
    """

    failure: Failure
    time: float
    hit: List[int] = field(default_factory=list)
    rejoin: List[int] = field(default_factory=list)
    target: str = ""
    skipped: str = ""
    ended: Optional[float] = None
    heal_optional: bool = False


def newest_commit(path: str, tail_bytes: int = 1 << 16) -> int:
    """The newest committed ``step`` among the step records in the last ``tail_bytes`` of a JSON-lines event log
    (-1: none, or no such file). A torn or foreign line is skipped."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail_bytes))
            lines = f.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return -1
    newest = -1
    for line in lines:
        try:
            record = json.loads(line)
            if isinstance(record, dict) and "event" not in record and record.get("committed") is True:
                newest = max(newest, int(record["step"]))
        except (ValueError, TypeError, KeyError):
            continue
    return newest


class Injector:
    """Applies failures to ``job`` and tracks which replica groups are in it.

    Args:
        job: the running job (its groups started by the caller).
        alive: replica groups running now.
        fault_dir: the ``FTBRIDGE_FAULT_DIR`` the job's groups were started with.
        seed: seeds the choice of target (with the failure's index).
        timeout_s: longest wait for a fault to fire or a process to die.
        spares: warm spares the runner started (:mod:`ftbridge.harness.chaos.spares`). Targets are
            always the processes that hold a group id now (:meth:`LocalJob.worker_pids
            <ftbridge.harness.local_job.LocalJob.worker_pids>` reads the group's latest ``start``
            records, which a spare writes when it takes the id over), never a standing-by spare;
            with spares, ``scale_down`` is skipped (:data:`~ftbridge.harness.chaos.spares.SCALE_DOWN_WITH_SPARES`).
    """

    def __init__(self, job: LocalJob, alive: Set[int], fault_dir: str, seed: int, timeout_s: float = 180,
                 spares: int = 0) -> None:
        self.job = job
        self.spares = spares
        self.alive = set(alive)
        self.fault_dir = fault_dir
        self.seed = seed
        self.timeout_s = timeout_s

    # -- dispatch ---------------------------------------------------------
    def inject(self, failure: Failure) -> Injected:
        """Apply ``failure``; see :class:`~ftbridge.harness.chaos.schedule.FailureKind` for each kind."""
        rng = random.Random(f"{self.seed}:{failure.index}")
        kind = failure.kind
        need = 3 if kind == FailureKind.KILL_DONOR_IN_HEAL else 2
        if kind in _TAKE_A_GROUP_OUT and len(self.alive) < need:
            return Injected(failure, time.time(), skipped=f"only {len(self.alive)} replica groups running, "
                                                          f"{kind.value} needs {need}")
        handler = {
            FailureKind.KILL_RANK: self._kill_rank,
            FailureKind.KILL_GROUP: self._kill_group,
            FailureKind.HANG: self._hang,
            FailureKind.KILL_JOINER_IN_HEAL: self._kill_in_heal,
            FailureKind.KILL_DONOR_IN_HEAL: self._kill_in_heal,
            FailureKind.KILL_IN_CHECKPOINT: self._kill_in_checkpoint,
            FailureKind.LIGHTHOUSE_OUTAGE: self._lighthouse_outage,
            FailureKind.SCALE_DOWN: self._scale_down,
            FailureKind.SCALE_UP: self._scale_up,
            FailureKind.LIGHTHOUSE_HANG: self._lighthouse_hang,
            FailureKind.LIGHTHOUSE_RESTART_EMPTY: self._lighthouse_restart_empty,
            FailureKind.PARTITION_LIGHTHOUSE: self._cut_one,
            FailureKind.LOSSY_LINK: self._cut_one,
            FailureKind.PARTITION_ALL: self._partition_all,
            FailureKind.SLOW_GROUP: self._slow_group,
            FailureKind.PARTITION_PEER: self._partition_peer,
        }[kind]
        try:
            return handler(failure, rng)
        except _NoTarget as e:
            return Injected(failure, time.time(), skipped=str(e))

    # -- kinds ------------------------------------------------------------
    def _keep_a_holder(self, victims: Set[int], need: int = 1) -> None:
        """Make sure at least ``need`` running groups outside ``victims`` hold the job's newest committed step (read
        from the groups' rank-0 event logs), waiting up to :data:`HOLDER_WAIT_S` for a group one step behind.

        Killing every holder of the newest steps is a double fault no in-memory replica survives: the steps
        would be lost, and the others stop with ``QuorumGap`` (docs/chaos.md, "Failure kinds").

        Raises:
            _NoTarget: fewer holders; the failure is skipped with that reason.
        """
        logs = {g: self.job.event_log(g, 0) for g in self.alive}
        frontier = max((newest_commit(path) for path in logs.values()), default=-1)
        deadline = time.monotonic() + HOLDER_WAIT_S
        while frontier >= 0:
            held = sorted(g for g in self.alive - victims if newest_commit(logs[g]) >= frontier)
            if len(held) >= need:
                return
            if time.monotonic() >= deadline:
                raise _NoTarget(f"only {len(held)} running replica group(s) other than the one(s) it would kill hold "
                                f"the job's newest committed step {frontier} (it needs {need}): the kill could take "
                                "the last holder of the newest state, a double fault no in-memory replica survives")
            time.sleep(0.1)

    def _pick(self, rng: random.Random) -> int:
        """A replica group to hit, drawn from the running ones.

        Raises:
            _NoTarget: the group drawn has no running ranks (killed by the previous failure and not back
                yet: its restart, or a spare taking its id, is still starting); the failure is skipped.
        """
        g = rng.choice(sorted(self.alive))
        if not self.job.worker_pids(g):
            raise _NoTarget(f"group {g} has no running ranks yet (its restart, or a spare taking its id, is "
                            "still starting)")
        return g

    def _shared(self, g: int) -> str:
        """``""``, or a note when two processes hold group ``g`` (:meth:`LocalJob.holding_pids
        <ftbridge.harness.local_job.LocalJob.holding_pids>`): a failure then hits the newer one, and the older one
        may go on as the group without a heal, so the group's recovery is judged as after a hang."""
        pids = self.job.holding_pids(g)
        return f", one of {len(pids)} processes holding the group's id" if len(pids) > 1 else ""

    def _kill_rank(self, failure: Failure, rng: random.Random) -> Injected:
        g = self._pick(rng)
        self._keep_a_holder({g})
        pids, shared = self.job.worker_pids(g), self._shared(g)
        r = rng.choice(sorted(pids))
        t = time.time()
        _kill_and_wait(self.job, [pids[r]], self.timeout_s)
        return Injected(failure, t, [g], [g], f"group {g} rank {r} (pid {pids[r]}){shared}",
                        heal_optional=bool(shared))

    def _kill_group(self, failure: Failure, rng: random.Random) -> Injected:
        g = self._pick(rng)
        self._keep_a_holder({g})
        shared = self._shared(g)
        t = time.time()
        pids = self.job.kill_workers(g, timeout_s=self.timeout_s)
        return Injected(failure, t, [g], [g], f"group {g} (pids {', '.join(map(str, pids))}){shared}",
                        heal_optional=bool(shared))

    def _hang(self, failure: Failure, rng: random.Random) -> Injected:
        g = self._pick(rng)
        pids = self.job.worker_pids(g)
        r = rng.choice(sorted(pids))
        t = time.time()
        stop_for([pids[r]], failure.duration_s)
        # No heal is needed when the others never committed without it (they too waited the hang out).
        return Injected(failure, t, [g], [g], f"group {g} rank {r} (pid {pids[r]}) stopped "
                                              f"{failure.duration_s:.0f} s", heal_optional=True)

    def _kill_in_heal(self, failure: Failure, rng: random.Random) -> Injected:
        g = self._pick(rng)
        joiner = failure.kind == FailureKind.KILL_JOINER_IN_HEAL
        self._keep_a_holder({g}, need=1 if joiner else 2)  # the donor, whichever it is, holds the newest step
        name = "heal_recv" if joiner else "heal_send"
        # The joiner's trigger, armed before the kill, names the group: its first heal after its restart meets
        # it. The donor's fires in whichever group torchft picks to send, so it is armed once the others are
        # together again (_arm_donor).
        if joiner:
            faults.arm(self.fault_dir, name, group=g)
        t = time.time()
        self.job.kill_workers(g, timeout_s=self.timeout_s)
        if not joiner:
            unarmed = self._arm_donor(g, t)
            if unarmed:
                return Injected(failure, t, [g], [g], f"group {g} killed; its heal donor not killed: {unarmed}")
        victim = self._fire(name, g if joiner else None, failure.index, arm=False)
        hit = sorted({g, victim})
        who = "joiner" if joiner else "donor"
        return Injected(failure, t, hit, hit, f"group {g} killed; its heal {who} group {victim} killed mid-transfer")

    def _arm_donor(self, g: int, killed_at: float) -> str:
        """Arm the donor's fault point for group ``g``'s heal, once every other running group has committed with
        all of them taking part since ``killed_at``; ``""`` when armed, else why not.

        A kill can leave a survivor a step behind (it discarded a step the others committed); its heal then
        comes first, and its donor is the only holder of the newest step. Armed before that heal, the point
        would take that last holder (a double fault; :meth:`_keep_a_holder`).
        """
        others = sorted(self.alive - {g})

        def together() -> bool:
            return all(any(e["committed"] and e["time"] > killed_at and e["participants"] == len(others)
                           for e in self.job.steps(o)) for o in others)

        try:
            self.job.wait_until(together, DONOR_SYNC_S, f"replica groups {others} to commit together")
            self._keep_a_holder({g}, need=2)
        except (TimeoutError, _NoTarget) as e:
            return (str(e).splitlines() or [repr(e)])[0]
        if self.job.healed_since(g, killed_at):
            return "its restart healed before the other groups were together again"
        faults.arm(self.fault_dir, "heal_send", group=None)
        return ""

    def _kill_in_checkpoint(self, failure: Failure, rng: random.Random) -> Injected:
        # Whichever group is the writer (replica rank 0 of the quorum) at the next scheduled save.
        self._keep_a_holder(set(), need=2)
        t = time.time()
        victim = self._fire("checkpoint_publish", None, failure.index)
        return Injected(failure, t, [victim], [victim], f"checkpoint writer group {victim} killed before publishing")

    def _fire(self, name: str, group: Optional[int], index: int, arm: bool = True) -> int:
        """Arm fault point ``name`` (unless already armed), wait until it fires, return the group that died."""
        if arm:
            faults.arm(self.fault_dir, name, group=group)
        self.job.wait_until(lambda: faults.fired(self.fault_dir, name), self.timeout_s,
                            f"fault point {name} to fire")
        fired = os.path.join(self.fault_dir, f"{name}.fired")
        with open(fired, encoding="utf-8") as f:
            victim = int(f.read().split("replica_group=")[1].split()[0])
        os.replace(fired, f"{fired}.{index}")
        return victim

    def _lighthouse_outage(self, failure: Failure, rng: random.Random) -> Injected:
        t = time.time()
        self.job.stop_lighthouse()
        try:
            time.sleep(failure.duration_s)  # the failure itself: no lighthouse for this long
        finally:
            self.job.start_lighthouse()
        return Injected(failure, t, [], [], f"lighthouse down {failure.duration_s:.0f} s", ended=time.time())

    def _scale_down(self, failure: Failure, rng: random.Random) -> Injected:
        if self.spares:
            return Injected(failure, time.time(), skipped=SCALE_DOWN_WITH_SPARES)
        if len(self.alive) < 3:
            return Injected(failure, time.time(), skipped=f"only {len(self.alive)} replica groups running: "
                                                          "scaling down would leave one group with no spare")
        g = self._pick(rng)
        self._keep_a_holder({g})
        t = time.time()
        self.job.stop_group(g)
        self.alive.discard(g)
        return Injected(failure, t, [g], [], f"group {g} left the job")

    def _scale_up(self, failure: Failure, rng: random.Random) -> Injected:
        outside = sorted(set(range(self.job.num_groups)) - self.alive)
        if not outside:
            return Injected(failure, time.time(), skipped="every planned replica group is already running")
        g = rng.choice(outside)
        t = time.time()
        self.job.start_group(g)
        self.alive.add(g)
        return Injected(failure, t, [], [g], f"group {g} joined the job")

    def _lighthouse_hang(self, failure: Failure, rng: random.Random) -> Injected:
        pid = self.job.lighthouse_pid
        t = time.time()
        stop_for([pid], failure.duration_s)
        return Injected(failure, t, [], [], f"lighthouse (pid {pid}) stopped {failure.duration_s:.0f} s",
                        ended=time.time())

    def _lighthouse_restart_empty(self, failure: Failure, rng: random.Random) -> Injected:
        pid = self.job.lighthouse_pid
        t = time.time()
        self.job.stop_lighthouse()  # SIGKILL; the new one starts with no state on the same address
        self.job.start_lighthouse()
        return Injected(failure, t, [], [], f"lighthouse (pid {pid}) killed, a fresh one started at once "
                                            f"(pid {self.job.lighthouse_pid})", ended=time.time())

    def _cut_one(self, failure: Failure, rng: random.Random) -> Injected:
        g = self._pick(rng)
        t = time.time()
        if failure.kind == FailureKind.PARTITION_LIGHTHOUSE:
            self._link_fault([g], "blackhole", failure.duration_s)
            # The others drop the group after the heartbeat timeout; it heals back unless nobody went on
            # without it.
            return Injected(failure, t, [g], [g], f"group {g} cut off from the lighthouse "
                                                  f"{failure.duration_s:.0f} s", heal_optional=True)
        self._link_fault([g], "oneway", failure.duration_s)
        # Its heartbeats still arrive, so it may stay in the quorum and commit with the others throughout.
        return Injected(failure, t, [], [g], f"group {g} deaf to the lighthouse's answers {failure.duration_s:.0f} s",
                        ended=time.time(), heal_optional=True)

    def _partition_all(self, failure: Failure, rng: random.Random) -> Injected:
        t = time.time()
        self._link_fault(sorted(self.alive), "blackhole", failure.duration_s)
        return Injected(failure, t, [], [], f"every group cut off from the live lighthouse "
                                            f"{failure.duration_s:.0f} s", ended=time.time())

    def _link_fault(self, groups: List[int], mode: str, duration_s: float) -> None:
        for g in groups:
            self.job.proxy(g).set(mode)
        try:
            time.sleep(duration_s)  # the failure itself: the links stay broken this long
        finally:
            for g in groups:
                self.job.proxy(g).set("pass")

    def _partition_peer(self, failure: Failure, rng: random.Random) -> Injected:
        g = self._pick(rng)
        hosts = self.job.group_hosts
        if hosts is None:
            raise RuntimeError("partition_peer needs the groups on hosts of their own (LocalJob(..., hosts=True))")
        t = time.time()
        hosts.cut(g)
        try:
            time.sleep(failure.duration_s)  # the failure itself: the group stays cut off this long
        finally:
            hosts.mend(g)
        # Its quorum calls still succeed: the others go on without it only while it is busy elsewhere; it
        # heals back if they committed steps without it, else commits with them again.
        return Injected(failure, t, [g], [g], f"group {g} cut off from its peers {failure.duration_s:.0f} s",
                        ended=time.time(), heal_optional=True)

    def _slow_group(self, failure: Failure, rng: random.Random) -> Injected:
        g = self._pick(rng)
        pids = sorted(self.job.worker_pids(g).values())
        t = time.time()
        half_speed(pids, failure.duration_s)
        return Injected(failure, t, [], [], f"group {g} (pids {', '.join(map(str, pids))}) at half speed "
                                            f"{failure.duration_s:.0f} s", ended=time.time())


def half_speed(pids: List[int], seconds: float) -> None:
    """Run ``pids`` at half speed for ``seconds``: stopped (SIGSTOP) for the first half of every
    :data:`SLOW_PERIOD_S` period, continued for the second (the failure itself)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        stop_for(pids, SLOW_PERIOD_S / 2)
        time.sleep(SLOW_PERIOD_S / 2)


def stop_for(pids: List[int], seconds: float) -> None:
    """SIGSTOP ``pids``, wait ``seconds`` (the failure itself), SIGCONT them, also if the wait is interrupted."""
    signal_pids(pids, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        signal_pids(pids, signal.SIGCONT)


def _kill_and_wait(job: LocalJob, pids: List[int], timeout_s: float) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    job.wait_until(lambda: not any(pid_alive(p) for p in pids), timeout_s, f"pids {pids} to die")


def describe(inj: Injected) -> Dict[str, object]:
    """A JSON-ready dict of an :class:`Injected`."""
    return {**inj.failure.to_json(), "time": inj.time, "ended": inj.ended, "hit": inj.hit, "rejoin": inj.rejoin,
            "target": inj.target, "skipped": inj.skipped}


def survivors(alive: Set[int], inj: Injected) -> Optional[List[int]]:
    """Groups that the failure did not take out (None when it hit nothing)."""
    return sorted(alive - set(inj.hit)) if inj.hit else None
