"""The chaos run: a whole job on this machine, failures from a schedule, invariants checked.

:func:`run_chaos` starts the lighthouse and the replica groups
(:class:`~ftbridge.harness.local_job.LocalJob`, each group one ``ftbridge-run``),
injects each scheduled failure (:mod:`ftbridge.harness.chaos.inject`), waits for the
job to recover from it before the next one (so a group with state always
survives), checks the invariants on the event logs after every failure and at
the end (:mod:`ftbridge.harness.chaos.invariants`), optionally trains a failure-free
run of the same length and seed to compare the final loss, and ends every
process it started. The result feeds :mod:`ftbridge.harness.chaos.report`.

With ``spares = K`` it also starts warm spares ``0..K-1`` once the job
commits together and waits until they stand by; a failed group then comes
back as whichever process takes its id (a spare or its torchrun restart),
and at the end every launch that holds no group id (standing-by spares,
demoted restarts) is stopped by PID before the active groups are told to
stop (:mod:`ftbridge.harness.chaos.spares`).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Dict, List, Optional, Sequence, Tuple

from ftbridge.faults import ENV_DIR
from ftbridge.harness import netns
from ftbridge.harness.chaos import invariants, spares, verdict
from ftbridge.harness.chaos.inject import Injected, Injector, describe
from ftbridge.harness.chaos.schedule import (
    HOSTED,
    LIGHTHOUSE_FAULTS,
    LIGHTHOUSE_PROCESS,
    PROXIED,
    Failure,
    FailureKind,
)
from ftbridge.harness.local_job import GroupProcess, LocalJob, started_by
from ftbridge.launch.processes import cpu_seconds, pid_alive, stop_process_groups

logger = logging.getLogger("ftbridge.harness.chaos")


@dataclass
class ChaosSettings:
    """How to run the job under chaos.

    Attributes:
        workdir: folder for logs, event logs, the report.
        groups: planned replica groups (one is held back at the start when the
            schedule has a scale-up).
        nproc: ranks per replica group.
        script_args: arguments of ``scripts/train_lm.py`` (model size, ZeRO stage ...).
        seed: seeds the schedule and the choice of targets.
        cross_replica_timeout_s: the job's cross-replica timeout (a hang lasts longer).
        quorum_timeout_s: the job's quorum timeout: a rank that can neither commit nor ride out its
            lighthouse exits after it.
        heartbeat_timeout_ms: the lighthouse's heartbeat timeout.
        join_timeout_ms: the lighthouse's join timeout.
        recovery_timeout_s: longest wait for the job to recover from one failure.
        tail_steps: steps trained after the last failure, at least (more if the job commits more within the
            recovery bound: a group that falls out of the quorum right after the last recovery is back by then).
        checkpoint_every: save a checkpoint every N steps (0: none; a
            ``kill_in_checkpoint`` failure turns it on at 20).
        baseline: also train a failure-free run of the same length to compare the final loss.
        loss_tolerance: largest accepted |final val loss - failure-free val loss| (nats), slots off.
        slots_loss_tolerance: the same with slots on, where the two runs train the same model up to the order
            of floating-point sums (check "same model as the failure-free run").
        slots_param_tolerance: with slots, the largest accepted ||p - p_failure_free|| / ||p_failure_free|| of
            the final parameters of every group at the last step (check "same parameters as the failure-free
            run").
        spares: warm spares (``ftbridge-run --spare-index k``) started once the job commits together,
            0 to ``groups`` (:func:`ftbridge.harness.chaos.spares.validate_spares`).
        slots: ``FTBRIDGE_SLOTS`` of the job and of the failure-free run (0: off); with slots the end
            checks add :func:`ftbridge.harness.chaos.coverage.same_samples`.
    """

    workdir: str
    groups: int = 3
    nproc: int = 2
    script_args: Sequence[str] = ()
    seed: int = 0
    cross_replica_timeout_s: float = 5.0
    quorum_timeout_s: float = 30.0
    heartbeat_timeout_ms: int = 2000
    join_timeout_ms: int = 1000
    recovery_timeout_s: float = 240.0
    tail_steps: int = 20
    checkpoint_every: int = 0
    baseline: bool = True
    loss_tolerance: float = 0.15
    slots_loss_tolerance: float = 1e-3
    slots_param_tolerance: float = 1e-2
    spares: int = 0
    slots: int = 0

    @property
    def loss_check(self) -> Tuple[str, float]:
        """The final-loss check's name and tolerance (nats): with slots the failure-free run's model, else its
        loss."""
        if self.slots:
            return "same model as the failure-free run", self.slots_loss_tolerance
        return "final loss within tolerance", self.loss_tolerance

    @property
    def settle_s(self) -> float:
        """How long after a fault with an end the job's pauses still count against it, seconds: the
        lighthouse's heartbeat and join timeouts, in which the way back to it forms a new quorum."""
        return (self.heartbeat_timeout_ms + self.join_timeout_ms) / 1000

    @property
    def recovery_bound_s(self) -> float:
        """Longest survivor stall the configured timeouts allow, plus slack for this machine.

        A failure is noticed by the lighthouse after its heartbeat timeout, or
        by a survivor's all-reduce after the cross-replica timeout (a hang);
        the next quorum waits at most the join timeout; 10 s cover a few steps
        and process scheduling on 2 shared CPU cores.
        """
        return (self.heartbeat_timeout_ms + self.join_timeout_ms) / 1000 + self.cross_replica_timeout_s + 10.0

    @property
    def silence_bound_s(self) -> float:
        """Longest a live rank may go without a commit: its quorum timeout, then the recovery bound."""
        return self.quorum_timeout_s + self.recovery_bound_s


@dataclass
class Outcome:
    """One injected failure and how the job got over it."""

    injected: Injected
    recovered: bool
    recovery: Optional[invariants.Recovery] = None
    violations: List[str] = field(default_factory=list)
    outage: Optional[invariants.OutagePause] = None
    """For a lighthouse outage: the survivor that lost the most steps (:func:`invariants.outage_pause`)."""
    spins: List[str] = field(default_factory=list)
    """Ranks that burned CPU without stepping from the injection to the recovery (:func:`invariants.spinning_ranks`)."""
    began: Optional[float] = None
    """When the injection began (seconds since the epoch): a death it explains comes after this."""
    done: Optional[float] = None
    """When the runner judged the job recovered from it, or gave up (seconds since the epoch)."""

    def to_json(self) -> Dict[str, Any]:
        rec = self.recovery
        return {**describe(self.injected), "recovered": self.recovered,
                "survivors_recovery_s": rec.survivors_s if rec else None,
                "rejoin_s": rec.rejoin_s if rec else None, "discarded": rec.discarded if rec else None,
                "outage_steps_lost": self.outage.steps_lost if self.outage else None,
                "outage_pause_s": self.outage.pause_s if self.outage else None,
                "violations": self.violations, "spins": self.spins}


@dataclass
class ChaosResult:
    """Everything a chaos run measured."""

    settings: ChaosSettings
    schedule: List[Failure]
    outcomes: List[Outcome]
    events: List[Dict[str, Any]]
    violations: List[str]
    final_step: int
    final_loss: Optional[float]
    baseline_loss: Optional[float]
    leftover_pids: List[int]
    wall_s: float
    """Wall time of the chaos run (start of the job to the end checks), seconds; the failure-free run is not in it."""
    checks: List[invariants.Check] = field(default_factory=list)
    """The checks that ran at the end, each with what it judged and found (``violations`` flattens them)."""
    spare_pids: List[int] = field(default_factory=list)
    """Standing-by rank PIDs (spares, demoted restarts) the runner stopped at the end."""
    log_tails: str = ""
    """When the run is not :attr:`ok`: each launch's failure lines and last lines (``LocalJob.tails``), so that a
    failed run in CI tells what its ranks did after the job's folder is gone; empty otherwise."""

    @property
    def ok(self) -> bool:
        """Every failure recovered from and every invariant held."""
        return not self.violations and all(o.recovered for o in self.outcomes if not o.injected.skipped)


def _outage_pause(events: Sequence[Dict[str, Any]], inj: Injected, alive: Sequence[int], settle_s: float
                  ) -> Optional[invariants.OutagePause]:
    """The pause around a lighthouse fault or a peer partition and ``settle_s`` after it (``None`` for other
    failures): for a lighthouse fault the worst survivor's (the groups it did not hit); for a group cut off
    from its peers the job's, the group that lost the fewest steps (either side of the cut may be the one
    that stands aside, :class:`ftbridge.manager.stand_aside.StandAside`)."""
    if inj.failure.kind not in LIGHTHOUSE_FAULTS | HOSTED or inj.ended is None:
        return None
    hosted = inj.failure.kind in HOSTED
    pauses = [invariants.outage_pause([e for e in events if "event" not in e and e["replica_group"] == g
                                       and e["group_rank"] == 0], inj.time, inj.ended, settle_s)
              for g in alive if hosted or g not in inj.hit]
    found: List[invariants.OutagePause] = [p for p in pauses if p is not None]
    if not found:
        return None
    return (min if hosted else max)(found, key=lambda p: p.steps_lost)


def _all_together(job: LocalJob, alive: Sequence[int], since: float) -> bool:
    """Every running group committed a step with all of them participating, after ``since``."""
    for g in alive:
        if not any(e["committed"] and e["time"] > since and e["participants"] == len(alive) for e in job.steps(g)):
            return False
    return True


def _wait_recovered(job: LocalJob, inj: Injected, alive: Sequence[int], timeout_s: float, settle_s: float) -> bool:
    """Wait until the hit groups are back and every running group commits together; after a fault with an
    end (a lighthouse or link fault, a slowed group), together again ``settle_s`` after that end."""
    deadline = time.monotonic() + timeout_s
    since = inj.time if inj.ended is None else inj.ended + settle_s
    try:
        for g in inj.rejoin:
            if inj.heal_optional:  # a hang: heal if the others went on, else commit with them again
                job.wait_until(lambda: job.healed_since(g, inj.time) or _all_together(job, alive, inj.time),
                               max(1.0, deadline - time.monotonic()), f"replica group {g} to rejoin")
            else:
                job.wait_heal(g, inj.time, max(1.0, deadline - time.monotonic()), f"replica group {g} to heal back")
        job.wait_until(lambda: _all_together(job, alive, since), max(1.0, deadline - time.monotonic()),
                       f"replica groups {list(alive)} to commit together")
        return True
    except TimeoutError as e:
        logger.error("not recovered from failure %d (%s): %s", inj.failure.index, inj.failure.kind.value,
                     (str(e).splitlines() or [repr(e)])[0])
        return False


def _job(settings: ChaosSettings, name: str, env: Dict[str, str], together: bool = False,
         kinds: AbstractSet[FailureKind] = frozenset()) -> LocalJob:
    job = LocalJob(os.path.join(settings.workdir, name), settings.groups, settings.nproc,
                   [*settings.script_args, "--steps", str(10**9)], max_restarts=1000,
                   lighthouse_min_replicas=settings.groups if together else None,
                   heartbeat_timeout_ms=settings.heartbeat_timeout_ms, join_timeout_ms=settings.join_timeout_ms,
                   env={"FTBRIDGE_CROSS_REPLICA_TIMEOUT_S": str(settings.cross_replica_timeout_s),
                        "FTBRIDGE_QUORUM_TIMEOUT_S": str(settings.quorum_timeout_s),
                        "FTBRIDGE_SLOTS": str(settings.slots), **env},
                   lighthouse_process=bool(kinds & LIGHTHOUSE_PROCESS), proxies=bool(kinds & PROXIED),
                   hosts=bool(kinds & HOSTED))
    job.script_args += ["--stop-file", os.path.join(job.workdir, "stop")]
    if settings.slots:  # the final parameters, for the check against the failure-free run's
        job.script_args += ["--save-params", os.path.join(job.workdir, "params", "group{replica_group}.st")]
    return job


def run_chaos(settings: ChaosSettings, schedule: List[Failure], progress: Any = None) -> ChaosResult:
    """Run the job under ``schedule`` and check it.

    Args:
        settings: the job and its timeouts.
        schedule: from :func:`ftbridge.harness.chaos.schedule.make_schedule`.
        progress: optional ``tqdm``-like object; ``update(1)`` per failure.

    Returns:
        The :class:`ChaosResult` (the run's processes have all ended).

    Raises:
        ValueError: ``settings.spares`` out of range, or a kind that needs the groups on hosts of their own
            (:data:`~ftbridge.harness.chaos.schedule.HOSTED`) on a machine or with spares that cannot
            (before anything starts).
        TimeoutError: the job did not start (no first commit) within the recovery timeout.
    """
    spares.validate_spares(settings.spares, settings.groups)
    check_hosted({f.kind for f in schedule}, settings.spares)
    t_start = time.time()
    fault_dir = os.path.join(settings.workdir, "faults")
    job = _job(settings, "chaos", {ENV_DIR: fault_dir}, kinds={f.kind for f in schedule})
    ckpt_dir = os.path.join(job.workdir, "checkpoints")
    every = settings.checkpoint_every or (20 if any(f.kind == FailureKind.KILL_IN_CHECKPOINT for f in schedule) else 0)
    if every:
        job.script_args += ["--checkpoint-dir", ckpt_dir, "--checkpoint-every", str(every)]
    kinds = {f.kind for f in schedule}
    # A scale-up needs a group outside the job: hold one back unless a scale-down makes room first.
    first = {k: min(f.index for f in schedule if f.kind == k) for k in kinds}
    needs_room = (FailureKind.SCALE_UP in kinds
                  and first.get(FailureKind.SCALE_DOWN, 10**9) > first[FailureKind.SCALE_UP])
    # With spares, scale_down is skipped (a spare would take the id), so a scale-up always needs a held-back group.
    needs_room = needs_room or (FailureKind.SCALE_UP in kinds and settings.spares > 0)
    held_back = {settings.groups - 1} if needs_room else set()
    alive = set(range(settings.groups)) - held_back
    outcomes: List[Outcome] = []
    stopped: List[int] = []
    try:
        job.start(groups=sorted(alive))
        job.wait_until(lambda: _all_together(job, sorted(alive), 0.0), settings.recovery_timeout_s,
                       "every replica group to commit together")
        _start_spares(job, settings.spares, settings.recovery_timeout_s)
        t0 = time.time()
        injector = Injector(job, alive, fault_dir, settings.seed, spares=settings.spares)
        for failure in schedule:
            time.sleep(max(0.0, t0 + failure.at_s - time.time()))  # the schedule is in wall time
            t_before, cpu_before = time.time(), _cpu(job.all_worker_pids())
            inj = injector.inject(failure)
            alive = injector.alive
            if inj.skipped:
                logger.warning("failure %d (%s) skipped: %s", failure.index, failure.kind.value, inj.skipped)
                outcomes.append(Outcome(inj, recovered=True))
            else:
                logger.info("failure %d: %s: %s", failure.index, failure.kind.value, inj.target)
                ok = _wait_recovered(job, inj, sorted(alive), settings.recovery_timeout_s, settings.settle_s)
                t_after, cpu_after = time.time(), _cpu(list(cpu_before))
                events = job.events()
                used = {p: cpu_after[p] - c for p, c in cpu_before.items() if p in cpu_after}
                spins = [str(v) for v in invariants.spinning_ranks(used, events, t_before, t_after)]
                rec = invariants.recovery(events, inj.ended or inj.time, inj.hit, rejoin=inj.rejoin,
                                          heal_optional=inj.heal_optional)
                found = [str(v) for v in invariants.check_all(events)]
                new = [v for v in found if all(v not in o.violations for o in outcomes)]
                outcomes.append(Outcome(inj, ok, rec, new, _outage_pause(events, inj, sorted(alive), settings.settle_s),
                                        spins, t_before, t_after))
                for v in new + spins:
                    logger.error("invariant broken after failure %d: %s", failure.index, v)
                if not ok:
                    break
            if progress is not None:
                progress.update(1)
        t_stop = time.time()
        if all(o.recovered for o in outcomes):
            active, stopped = _stop_standing_by(job, sorted(alive), settings.recovery_timeout_s)
            final_step = job.stop_soon(settings.tail_steps, lead_s=settings.recovery_bound_s)
            ended = _wait_launches(job, active, settings.recovery_timeout_s)
        else:  # broken off: the job may hold no live group to stop in order; the checks judge what happened
            stopped, final_step = [], max((e["step"] for e in job.events() if "event" not in e and e["committed"]),
                                          default=0)
            ended = None  # not judged: the report lists only the checks that ran
    finally:
        job.stop()
    events = job.events()
    pids = job.all_worker_pids() + [gp.proc.pid for launches in job.groups.values() for gp in launches] + [
        gp.proc.pid for gp in job.spares.values()]
    leftover = [p for p in pids if pid_alive(p)]
    checks = verdict.end_checks(settings, events, outcomes, sorted(alive), final_step, len(pids), leftover,
                         ckpt_dir if every else None)
    checks.extend(verdict.death_checks(settings, job, events, outcomes, t_stop))
    if ended is not None:
        checks.append(ended)
    final_loss = verdict.final_loss(events)
    chaos_wall_s = time.time() - t_start  # the failure-free run below is not part of the chaos run's time
    baseline_loss = None
    if settings.baseline:
        baseline_loss, baseline_dir = _baseline(settings, final_step)
        name, tolerance = settings.loss_check
        checks.append(invariants.Check(
            name, f"{_loss_text(final_loss)} against failure-free {_loss_text(baseline_loss)}, tolerance {tolerance:g}",
            invariants.final_loss_close(final_loss, baseline_loss, tolerance)))
        if settings.slots:
            checks.append(verdict.same_parameters(os.path.join(job.workdir, "params"),
                                                  os.path.join(baseline_dir, "params"), final_step,
                                                  settings.slots_param_tolerance))
    violations = [str(v) for c in checks for v in c.violations]
    result = ChaosResult(settings, schedule, outcomes, events, violations, final_step, final_loss, baseline_loss,
                         leftover, chaos_wall_s, checks, stopped)
    if not result.ok:
        result.log_tails = job.tails()
    return result


def check_hosted(kinds: AbstractSet[FailureKind], spares: int) -> None:
    """Refuse kinds that need each group on a host of its own where that cannot be.

    Raises:
        ValueError: naming the kinds, the reason (not root, tools missing, warm spares) and the fix.
    """
    hosted = sorted(k.value for k in kinds & HOSTED)
    if not hosted:
        return
    why = netns.available() or ("warm spares do not run on hosts of their own" if spares else "")
    if why:
        raise ValueError(f"failure kinds {', '.join(hosted)} put each replica group in a network namespace of "
                         f"its own, and here {why}: run as root with iproute2 and util-linux, without --spares, "
                         "or drop the kinds")


def _loss_text(loss: Optional[float]) -> str:
    return "none" if loss is None else f"{loss:.4f}"


def _cpu(pids: Sequence[int]) -> Dict[int, float]:
    """CPU seconds so far of each of ``pids`` still running."""
    found = {p: cpu_seconds(p) for p in pids}
    return {p: c for p, c in found.items() if c is not None}


def _start_spares(job: LocalJob, count: int, timeout_s: float) -> None:
    """Start warm spares ``0..count-1`` and wait until every rank of each stands by."""
    for k in range(count):
        job.start_spare(k)
    job.wait_until(lambda: all(job.spare_ready(k) for k in range(count)), timeout_s,
                   f"{count} warm spares to stand by")


def _stop_standing_by(job: LocalJob, alive: Sequence[int], timeout_s: float
                      ) -> Tuple[Dict[int, GroupProcess], List[int]]:
    """Stop every live launch that holds no group id now; return (the holders' launches, the standing-by PIDs).

    The holders of ``alive`` are found from the groups' latest ``start`` records
    (:func:`spares.holders`); any other live launch is a standing-by spare, a demoted
    restart or a restart still starting. The latter are first given up to ``timeout_s`` to
    stand by: a rank ended inside DeepSpeed's start-up can leave its JIT-build lock file
    behind (``torch_extensions/.../lock``), and every later DeepSpeed start on the machine
    then waits for it forever. Each is then stopped with SIGTERM, then SIGKILL (its torchrun
    ends its ranks), before the stop file, so none takes over a group that finished first.

    Raises:
        RuntimeError: an active group has no live holder process, or its holder's launch is unknown.
    """
    held = spares.holders(job.events(), alive, lambda p, t: pid_alive(p) and started_by(p, t))
    active: Dict[int, GroupProcess] = {}
    for g in alive:
        pids = [p for p in held[g].values() if pid_alive(p)]
        launch = job.launch_of(pids[0]) if pids else None
        if launch is None:
            raise RuntimeError(f"replica group {g}: no live process holds it (start records: {held[g]})")
        active[g] = launch
    held_pids = {p for ranks in held.values() for p in ranks.values()}
    keep = {id(gp) for gp in active.values()}
    launches = [*(gp for ls in job.groups.values() for gp in ls), *job.spares.values()]
    others = [gp for gp in launches if id(gp) not in keep and gp.proc.poll() is None]
    standby: List[int] = []

    def all_standing_by() -> bool:
        ready = job.spare_events()
        standby[:] = [p for p in spares.standing_by(ready, held_pids)
                      if pid_alive(p) and started_by(p, max(e["time"] for e in ready if e.get("pid") == p))]
        by_launch: Dict[int, int] = {}
        for p in standby:
            gp = job.launch_of(p)
            if gp is not None:
                by_launch[id(gp)] = by_launch.get(id(gp), 0) + 1
        return all(gp.proc.poll() is not None or by_launch.get(id(gp), 0) >= job.nproc for gp in others)

    try:
        job.wait_until(all_standing_by, timeout_s, "every launch that holds no replica group to stand by", poll_s=0.5)
    except TimeoutError as e:  # stop them anyway; the run's checks still judge what happened
        logger.warning("%s", (str(e).splitlines() or [repr(e)])[0])
    if others:
        logger.info("stopping %d launch(es) that hold no replica group (standing-by ranks %s)", len(others), standby)
        stop_process_groups([gp.proc for gp in others], grace_s=15)
    return active, standby


def _wait_launches(job: LocalJob, active: Dict[int, GroupProcess], timeout_s: float) -> invariants.Check:
    """Wait up to ``timeout_s`` in all until the launch holding each active group has exited (it trains to the
    stop step first).

    Returns:
        The check "every launch ends with the job", with a violation per launch still running at the deadline
        (for example a group restarted after the others finished, which torchrun restarts again each time it
        finds no peer to heal from); the caller's ``job.stop()`` ends those.
    """
    deadline = time.monotonic() + timeout_s
    late = []
    for g, gp in sorted(active.items()):
        proc = gp.proc
        try:
            job.wait_until(lambda: proc.poll() is not None, max(1.0, deadline - time.monotonic()),
                           f"the launch holding replica group {g} ({gp.log_path}) to exit")
        except TimeoutError:
            late.append(invariants.Violation(
                "every launch ends with the job", f"the launch holding replica group {g} ({gp.log_path}) still "
                f"ran {timeout_s:.0f} s after the job's stop (its log tells why)"))
    return invariants.Check("every launch ends with the job", f"{len(active)} launches waited for", late)


def _baseline(settings: ChaosSettings, steps: int) -> Tuple[Optional[float], str]:
    """Final validation loss of a failure-free run of ``steps`` steps, all groups from the start, and its folder."""
    job = _job(settings, "baseline", {}, together=True)
    job.script_args += ["--steps", str(steps)]  # the last --steps wins
    try:
        job.start()
        job.wait(timeout_s=max(600.0, steps * 1.0))
    finally:
        job.stop()
    return verdict.final_loss(job.events()), job.workdir
