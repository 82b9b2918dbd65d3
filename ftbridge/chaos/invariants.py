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
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

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
    """Within one launch of one rank, committed steps strictly increase."""
    out = []
    starts = _launch_starts(events)
    last: Dict[Tuple[int, int, int], int] = {}
    for e in _step_records(events):
        if not e["committed"]:
            continue
        key = (e["replica_group"], e["group_rank"])
        launch = sum(1 for t in starts.get(key, []) if t <= e["time"])
        k = (*key, launch)
        if k in last and e["step"] <= last[k]:
            out.append(Violation("monotonic commits", f"replica group {key[0]} rank {key[1]} committed step "
                                 f"{e['step']} after step {last[k]} in the same launch"))
        last[k] = e["step"]
    return out


def no_committed_step_lost(events: Sequence[Record]) -> List[Violation]:
    """The job's progress never goes back: every commit is at or past the frontier.

    The frontier is the highest step committed by any replica so far. A
    commit more than one step behind it means a replica trained on from an
    older state than the job had reached (for example a group restarted from
    step 0 with no peer to heal from). One exception: a replica that was
    frozen after its all-reduce of step ``s`` may commit ``s`` late, once it
    resumes; that is the same commit as the others' (same average), so it is
    accepted when its parameters equal those another replica had after ``s``.
    """
    out = []
    frontier = 0
    seen: Dict[int, set] = {}
    for e in _step_records(events):
        if not e["committed"]:
            continue
        late_same = e.get("param_checksum") is not None and e["param_checksum"] in seen.get(e["step"], set())
        if e["step"] + 1 < frontier and not late_same:
            out.append(Violation("no lost steps", f"replica group {e['replica_group']} rank {e['group_rank']} "
                                 f"committed step {e['step']} at t={e['time']:.3f} after the job had reached "
                                 f"step {frontier}"))
        frontier = max(frontier, e["step"])
        seen.setdefault(e["step"], set()).add(e.get("param_checksum"))
    return out


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


def replicas_identical_after_commit(events: Sequence[Record]) -> List[Violation]:
    """Every replica that committed step ``s`` holds the same parameters after it.

    :func:`orphan_commits` are left out: their state died with their group
    before any other group could hold or build on it.
    """
    orphans = {id(e) for e in orphan_commits(events)}
    by_step: Dict[int, Dict[str, List[str]]] = {}
    for e in _step_records(events):
        if e["committed"] and e.get("param_checksum") and id(e) not in orphans:
            by_step.setdefault(e["step"], {}).setdefault(e["param_checksum"], []).append(
                f"{e['replica_group']}/{e['group_rank']}")
    return [Violation("identical replicas", f"step {s}: different parameters on " +
                      "; ".join(f"{c} on {','.join(who)}" for c, who in sums.items()))
            for s, sums in sorted(by_step.items()) if len(sums) > 1]


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


def final_loss_close(chaos_loss: Optional[float], baseline_loss: Optional[float], tolerance: float
                     ) -> List[Violation]:
    """The final validation loss is within ``tolerance`` (absolute, nats) of a failure-free run."""
    if chaos_loss is None or baseline_loss is None:
        return [Violation("final loss", f"missing final validation loss (chaos {chaos_loss}, "
                                        f"failure-free {baseline_loss})")]
    if abs(chaos_loss - baseline_loss) > tolerance:
        return [Violation("final loss", f"{chaos_loss:.4f} against {baseline_loss:.4f} without failures: "
                                        f"differs by more than {tolerance}")]
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


def check_all(events: Sequence[Record]) -> List[Violation]:
    """The invariants that need only the event logs."""
    return (commits_never_repeat_or_go_back(events) + no_committed_step_lost(events)
            + replicas_identical_after_commit(events))
