"""Invariants of a fault-tolerant run, checked on its per-rank event logs.

Pure functions of the merged event records (:func:`ftbridge.events.read_events`)
and, for recovery, the injected failures: no clock, no processes, so they are
unit-tested on hand-written records and re-run on any finished run's logs.

Step records (no ``event`` key) carry ``replica_group``, ``group_rank``,
``time`` (s since the epoch), ``step`` (torchft's step after the step),
``committed``, ``participants``, ``quorum_id``, ``healed`` and
``param_checksum`` (same on every group rank: the full parameters).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

Record = Dict[str, Any]


@dataclass
class Violation:
    """One broken invariant."""

    invariant: str
    detail: str

    def __str__(self) -> str:
        return f"{self.invariant}: {self.detail}"


def _step_records(events: Iterable[Record]) -> List[Record]:
    return sorted((e for e in events if "event" not in e), key=lambda e: e["time"])


def _launch_starts(events: Iterable[Record]) -> Dict[Tuple[int, int], List[float]]:
    starts: Dict[Tuple[int, int], List[float]] = {}
    for e in events:
        if e.get("event") == "start":
            starts.setdefault((e["replica_group"], e["group_rank"]), []).append(e["time"])
    return {k: sorted(v) for k, v in starts.items()}


def commits_never_repeat_or_go_back(events: Sequence[Record]) -> List[Violation]:
    """Within one launch of one rank, committed steps strictly increase.

    A launch is the writing process (``pid``, in every record of current logs); records without one
    are assigned to the latest ``start`` before them. By pid, because with warm spares two processes
    may write one group's log at once: a group paused past the heartbeat timeout resumes, commits the
    step it was frozen in (late, behind the spare that took its id), and only then leaves.
    """
    out = []
    starts = _launch_starts(events)
    last: Dict[Tuple[int, int, Any], int] = {}
    for e in _step_records(events):
        if not e["committed"]:
            continue
        key = (e["replica_group"], e["group_rank"])
        launch = e["pid"] if "pid" in e else sum(1 for t in starts.get(key, []) if t <= e["time"])
        k = (*key, launch)
        if k in last and e["step"] <= last[k]:
            out.append(Violation("monotonic commits", f"replica group {key[0]} rank {key[1]} committed step "
                                 f"{e['step']} after step {last[k]} in the same launch"))
        last[k] = e["step"]
    return out


def no_committed_step_lost(events: Sequence[Record]) -> List[Violation]:
    """The job's progress never goes back: a commit behind the frontier must repeat a commit the job had.

    The frontier is the highest step committed by any replica so far. A
    commit at or past it is progress. A commit of an older step ``s`` is
    accepted only when its parameter checksum equals one another replica
    recorded after committing ``s``: a replica frozen after its all-reduce of
    ``s`` commits ``s`` late, once it resumes, with the same average (and a
    faster group's record of ``s + 1`` may simply be written first). Any
    other commit behind the frontier, even one step behind, is a replica that
    trained on from a state the job did not hold (for example a group
    restarted from step 0 with no peer to heal from) and is a violation; so is
    one without a checksum, which cannot be told apart from it (run with
    ``checksum_every=1``, the chaos runner's setting).
    """
    return _no_lost_judged(events).violations


def _no_lost_judged(events: Sequence[Record]) -> "Check":
    out = []
    frontier = 0
    seen: Dict[int, set] = {}
    commits = lagging = 0
    for e in _step_records(events):
        if not e["committed"]:
            continue
        commits += 1
        who = f"replica group {e['replica_group']} rank {e['group_rank']}"
        checksum = e.get("param_checksum")
        if e["step"] < frontier:
            lagging += 1
            if checksum is None:
                out.append(Violation("no lost steps", f"{who} committed step {e['step']} at t={e['time']:.3f} "
                                     f"behind the job's step {frontier} with no parameter checksum to show it "
                                     "repeats a commit the job had (run with checksum_every=1)"))
            elif checksum not in seen.get(e["step"], set()):
                out.append(Violation("no lost steps", f"{who} committed step {e['step']} at t={e['time']:.3f} "
                                     f"after the job had reached step {frontier}, with parameters {checksum} "
                                     f"that no replica had after step {e['step']}"))
        frontier = max(frontier, e["step"])
        if checksum is not None:
            seen.setdefault(e["step"], set()).add(checksum)
    return Check("no committed step lost", f"{commits} commits, {lagging} behind the frontier checked by "
                 "checksum", out)


def orphan_commits(events: Sequence[Record]) -> List[Record]:
    """Commits that no other replica group of the quorum shared, by a group that died right after.

    torchft's ``should_commit`` is an AND over the ranks of one group only.
    When a peer dies inside a cross-replica all-reduce, a ring all-reduce can
    complete on one group and fail on another: the first commits, the second
    discards. Had the first lived, the others would heal from it (it holds the
    newest step). If it died before its next step, nobody ever held that
    state and the others commit that step again from their own: seen in a CI
    chaos run (a heal donor killed just after such a commit). Returned: the
    step records (group rank 0 and 1 alike) of commits in a quorum of more
    than one participant that no other group committed, followed by a restart
    of that rank before its next step. The chaos report counts them.
    """
    steps = _step_records(events)
    starts = _launch_starts(events)
    committed_by: Dict[Tuple[int, Any], set] = {}
    by_rank: Dict[Tuple[int, int], List[Record]] = {}
    for e in steps:
        by_rank.setdefault((e["replica_group"], e["group_rank"]), []).append(e)
        if e["committed"]:
            committed_by.setdefault((e["step"], e["quorum_id"]), set()).add(e["replica_group"])
    out = []
    for (g, r), recs in by_rank.items():
        for i, e in enumerate(recs):
            if not e["committed"] or e.get("participants", 1) < 2 or committed_by[(e["step"], e["quorum_id"])] != {g}:
                continue
            nxt = recs[i + 1]["time"] if i + 1 < len(recs) else float("inf")
            if any(e["time"] < t < nxt for t in starts.get((g, r), [])):
                out.append(e)
    return out


@dataclass
class Check:
    """One check that ran on a run's records and what it found.

    Attributes:
        name: the invariant, as the report names it.
        judged: what it looked at (for example "412 commits compared at 206
            steps"), so a check that saw nothing cannot pass unnoticed.
        violations: what broke; empty when the check held.
    """

    name: str
    judged: str
    violations: List[Violation] = field(default_factory=list)

    @property
    def held(self) -> bool:
        """True when no violation was found."""
        return not self.violations

    def __str__(self) -> str:
        return f"{self.name}: {'held' if self.held else f'{len(self.violations)} violations'} ({self.judged})"


def replicas_identical_after_commit(events: Sequence[Record]) -> List[Violation]:
    """Every replica that committed step ``s`` holds the same parameters after it.

    See :func:`identical_replicas` (this returns its violations).
    """
    return identical_replicas(events).violations


def identical_replicas(events: Sequence[Record]) -> Check:
    """Judge "replicas identical after every commit" and say how many commits it compared.

    Every commit must carry a parameter checksum: one without (a run with
    ``checksum_every`` above 1, or 0) cannot be compared, and each such
    commit is a violation (the check refuses to pass what it did not see).
    A commit is compared when another rank or group committed the same step;
    commits of a step only one rank recorded are counted apart.
    :func:`orphan_commits` are left out: their state died with their group
    before any other group could hold or build on it.

    Returns:
        a :class:`Check` whose ``judged`` reads "N commits compared at S
        steps, U alone at their step, O orphan commits left out".
    """
    orphans = {id(e) for e in orphan_commits(events)}
    by_step: Dict[int, Dict[str, List[str]]] = {}
    unchecked: List[Record] = []
    for e in _step_records(events):
        if not e["committed"] or id(e) in orphans:
            continue
        if not e.get("param_checksum"):
            unchecked.append(e)
            continue
        by_step.setdefault(e["step"], {}).setdefault(e["param_checksum"], []).append(
            f"{e['replica_group']}/{e['group_rank']}")
    out = [Violation("identical replicas", f"step {s}: different parameters on " +
                     "; ".join(f"{c} on {','.join(who)}" for c, who in sums.items()))
           for s, sums in sorted(by_step.items()) if len(sums) > 1]
    if unchecked:
        steps = sorted({e["step"] for e in unchecked})
        out.append(Violation("identical replicas", f"{len(unchecked)} commits carry no parameter checksum "
                             f"(steps {steps[:5]}{' ...' if len(steps) > 5 else ''}): not compared; run with "
                             "checksum_every=1 (FTBRIDGE_CHECKSUM_EVERY=1) to judge every commit"))
    sizes = [sum(len(w) for w in sums.values()) for sums in by_step.values()]
    compared = sum(n for n in sizes if n > 1)
    judged = (f"{compared} commits compared at {sum(1 for n in sizes if n > 1)} steps, "
              f"{sum(1 for n in sizes if n == 1)} alone at their step, {len(orphans)} orphan commits left out")
    return Check("replicas identical after every commit", judged, out)


@dataclass
class Recovery:
    """How the job got over one failure.

    Attributes:
        survivors_s: injection to the first commit of a group the failure did
            not hit, in a quorum formed after the injection (seconds; None if
            none came).
        rejoin_s: injection to the hit group's first heal after it (seconds;
            None if it did not heal, e.g. it left for good); for a failure
            with ``heal_optional``, its first heal or first commit with the
            others, whichever comes first.
        discarded: steps discarded by any group rank 0 between the injection
            and the survivors' recovery.
    """

    survivors_s: Optional[float]
    rejoin_s: Optional[float]
    discarded: int = 0


def recovery(events: Sequence[Record], t_inject: float, hit: Sequence[int], until: float = float("inf"),
             rejoin: Optional[Sequence[int]] = None, heal_optional: bool = False) -> Recovery:
    """Measure recovery from a failure injected at ``t_inject`` that hit replica groups ``hit``.

    Args:
        events: merged records.
        t_inject: injection time, seconds since the epoch.
        hit: replica groups the failure hit (empty: all groups are survivors,
            e.g. a lighthouse outage).
        until: ignore records after this time (the next failure).
        rejoin: groups expected to heal into the job afterwards (default ``hit``;
            a scale-up hits nobody and rejoins the new group).
        heal_optional: the rejoining groups kept their state (a hang): a
            commit together with another group counts as rejoining too.
    """
    rejoin = hit if rejoin is None else rejoin
    recs = [e for e in _step_records(events) if t_inject <= e["time"] < until and e["group_rank"] == 0]
    before: Dict[int, Any] = {}
    for e in _step_records(events):
        if e["time"] < t_inject and e["group_rank"] == 0:
            before[e["replica_group"]] = e["quorum_id"]
    survivors_s = None
    discarded = 0
    for e in recs:
        if e["replica_group"] in hit:
            continue
        if not e["committed"]:
            discarded += 1
            continue
        changed = e["quorum_id"] != before.get(e["replica_group"])
        if changed or not hit:
            survivors_s = e["time"] - t_inject
            break
    rejoin_s = next((e["time"] - t_inject for e in recs if e["replica_group"] in rejoin
                     and (e["healed"] or (heal_optional and e["committed"] and e["participants"] > 1))), None)
    return Recovery(survivors_s, rejoin_s, discarded)


@dataclass(frozen=True)
class OutagePause:
    """What a lighthouse outage cost one survivor rank (:func:`outage_pause`).

    Attributes:
        pause_s: the longest time between two consecutive commits from the last commit before the
            outage to the first commit after it ended (seconds).
        step_s: median ``step_time_s`` of the committed steps before the outage (seconds).
        steps_lost: ``max(0, pause_s / step_s - 1)``: the pause beyond one ordinary step, in steps.
        committed: commits during the outage.
        reference_s: the longest such gap in a window of the outage's length just before it (the
            machine's own jitter; ``None`` without records there).
    """

    pause_s: float
    step_s: float
    steps_lost: float
    committed: int
    reference_s: Optional[float]


def outage_pause(records: Sequence[Record], t_down: float, t_up: float, settle_s: float = 0.0
                 ) -> Optional[OutagePause]:
    """How long one survivor rank went without a commit around a lighthouse outage (pure).

    Args:
        records: that rank's step records (``time``, ``committed``, ``step_time_s``), any order.
        t_down, t_up: when the lighthouse stopped and started again (s since the epoch).
        settle_s: also count the gaps in this long after ``t_up`` (seconds): the way back to the
            lighthouse (a new quorum, a rebuilt process group) can stall the job after its first
            commit past the outage.

    Returns:
        :class:`OutagePause`, or ``None`` when there is no commit before the outage or none after
        ``t_up + settle_s``.
    """
    commits = sorted(r["time"] for r in records if r.get("committed"))
    before = [t for t in commits if t < t_down]
    after = [t for t in commits if t >= t_up + settle_s]
    if not before or not after:
        return None
    window = [before[-1]] + [t for t in commits if t_down <= t < t_up + settle_s] + [after[0]]
    pause = max(b - a for a, b in zip(window, window[1:]))
    times = [r["step_time_s"] for r in sorted(records, key=lambda r: r["time"])
             if r.get("committed") and r["time"] < t_down and r.get("step_time_s") is not None]
    step_s = statistics.median(times[1:] or times) if times else pause
    ref = [t for t in before if t >= t_down - (t_up - t_down)]
    reference = max((b - a for a, b in zip(ref, ref[1:])), default=None)
    return OutagePause(pause, step_s, max(0.0, pause / step_s - 1.0) if step_s > 0 else 0.0,
                       sum(1 for t in commits if t_down <= t < t_up), reference)


SPIN_CPU_SHARE = 0.5
"""A rank that writes no step record may use at most this share of one core while it waits."""


def spinning_ranks(cpu_s: Mapping[int, float], events: Sequence[Record], start: float, end: float
                   ) -> List[Violation]:
    """Ranks that burned CPU without stepping between ``start`` and ``end`` (pure).

    A rank waiting for a quorum, a peer or the lighthouse must wait, not poll in a tight loop: one
    that wrote no step record (committed or discarded) in the window may use at most
    :data:`SPIN_CPU_SHARE` of a core.

    Args:
        cpu_s: PID -> CPU seconds it used between ``start`` and ``end`` (PIDs alive at both ends only:
            a process started or ended in the window is doing something else).
        events: merged records; step records carry the writer's ``pid``.
        start, end: the window, seconds since the epoch.
    """
    wall = end - start
    stepped = {e.get("pid") for e in _step_records(events) if start <= e["time"] <= end}
    return [Violation("no rank spins", f"pid {pid} used {used:.1f} s of CPU in {wall:.1f} s without writing a "
                                       "step record")
            for pid, used in sorted(cpu_s.items()) if wall > 0 and pid not in stepped and used > SPIN_CPU_SHARE * wall]


def silent_ranks(events: Sequence[Record], died: Mapping[int, float], bound_s: float) -> List[Violation]:
    """Ranks that lived on longer than ``bound_s`` without committing (pure).

    A rank that can neither commit nor ride out its lighthouse must exit within its quorum timeout (and
    torchrun restart it), not wait on. For every process that committed at least once, the longest time
    without a commit counts: between two of its commits, and from its last commit to its end (its
    death, or its last record when it lived to the end of the run). A pause the group announced
    by a ``stand_aside`` record (:class:`ftbridge.manager.stand_aside.StandAside`, bounded by its own setting) does
    not count.

    Args:
        events: merged records; step records and ``final`` records carry the writer's ``pid``.
        died: pid -> when it died (seconds since the epoch), for the processes that died.
        bound_s: the documented limit (the quorum timeout) plus the time the lighthouse and the
            slowest collective take to notice, seconds.
    """
    commits: Dict[int, List[float]] = {}
    aside: Dict[int, List[Tuple[float, float]]] = {}
    last: Dict[int, float] = {}
    for e in events:
        pid = e.get("pid")
        if pid is None:
            continue
        last[pid] = max(last.get(pid, 0.0), e["time"])
        if "event" not in e and e["committed"]:
            commits.setdefault(pid, []).append(e["time"])
        elif e.get("event") == "stand_aside":
            aside.setdefault(pid, []).append((e["time"], float(e["seconds"])))
    out = []
    for pid, times in sorted(commits.items()):
        times.sort()
        end = died.get(pid, last[pid])
        gaps = [(b - a - sum(s for t, s in aside.get(pid, []) if a <= t <= b), a)
                for a, b in zip(times, times[1:] + [max(end, times[-1])])]
        gap, since = max(gaps)
        if gap > bound_s:
            g, r = _identity(events, pid)
            clock = time.strftime("%H:%M:%S", time.localtime(since))
            out.append(Violation("no rank lives on without committing",
                                 f"replica group {g} rank {r} (pid {pid}) went {gap:.1f} s without a commit "
                                 f"from {clock} while alive, above {bound_s:.1f} s"))
    return out


def _identity(events: Sequence[Record], pid: int) -> Tuple[Any, Any]:
    for e in events:
        if e.get("pid") == pid:
            return e.get("replica_group"), e.get("group_rank")
    return None, None


def final_loss_close(chaos_loss: Optional[float], baseline_loss: Optional[float], tolerance: float
                     ) -> List[Violation]:
    """The final validation loss is within ``tolerance`` (absolute, nats) of a failure-free run."""
    if chaos_loss is None or baseline_loss is None:
        return [Violation("final loss", f"missing final validation loss (chaos {chaos_loss}, "
                                        f"failure-free {baseline_loss})")]
    if abs(chaos_loss - baseline_loss) > tolerance:
        return [Violation("final loss", f"{chaos_loss:.6f} against {baseline_loss:.6f} without failures: "
                                        f"differs by {abs(chaos_loss - baseline_loss):.2g}, more than {tolerance:g}")]
    return []


@dataclass
class Stats:
    """min / median / max of a list of seconds (None when empty)."""

    values: List[float] = field(default_factory=list)

    def text(self) -> str:
        if not self.values:
            return "-"
        return (f"{min(self.values):.1f} / {statistics.median(self.values):.1f} / "
                f"{max(self.values):.1f}")


def group_ranks_agree(events: Sequence[Record]) -> Tuple[int, List[Violation]]:
    """The ranks of a replica group take the same decision on every step they both recorded (pure).

    A step attempt is ``(group, quorum id, step before it)`` (``step - committed``: a commit advances the
    step, a discard does not); the same attempt may repeat in one quorum (a discard, then the retry). For
    every attempt, the i-th outcome of each rank that recorded an i-th outcome must be the same: one rank
    committing a step its group-mate discarded is a split inside the group. A rank that died before it
    wrote its record leaves a shorter list, which is not a disagreement.

    Returns:
        (attempts compared on more than one rank, violations).
    """
    outcomes: Dict[Tuple[Any, Any, int], Dict[Any, List[bool]]] = {}
    for e in _step_records(events):
        key = (e["replica_group"], e.get("quorum_id"), int(e["step"]) - int(bool(e["committed"])))
        outcomes.setdefault(key, {}).setdefault(e["group_rank"], []).append(bool(e["committed"]))
    out = []
    compared = 0
    for (g, q, step), by_rank in sorted(outcomes.items(), key=lambda kv: str(kv[0])):
        if len(by_rank) < 2:
            continue
        compared += 1
        for i in range(max(len(v) for v in by_rank.values())):
            seen = {r: v[i] for r, v in by_rank.items() if i < len(v)}
            if len(set(seen.values())) > 1:
                out.append(Violation("ranks of a group agree", f"replica group {g} quorum {q} step {step}: "
                                     f"committed on ranks {sorted(r for r, c in seen.items() if c)}, discarded "
                                     f"on ranks {sorted(r for r, c in seen.items() if not c)}"))
    return compared, out


def check_all(events: Sequence[Record]) -> List[Violation]:
    """The invariants that need only the event logs: the violations of :func:`log_checks`."""
    return [v for c in log_checks(events) for v in c.violations]


def log_checks(events: Sequence[Record]) -> List[Check]:
    """Run the invariants that need only the event logs; each says what it judged."""
    commits = sum(1 for e in _step_records(events) if e["committed"])
    compared, split = group_ranks_agree(events)
    return [Check("commits monotonic", f"{commits} commits", commits_never_repeat_or_go_back(events)),
            _no_lost_judged(events), identical_replicas(events),
            Check("ranks of a group agree", f"{compared} step attempts recorded on several ranks of a group", split)]
