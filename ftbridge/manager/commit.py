"""The per-step commit protocol of one rank as pure functions (no I/O).

QUORUM (:func:`decide_ride`, :class:`QuorumWait`), AGREE (every member's :class:`View`, summed in one
cross-replica all-reduce, judged by :func:`judge`), DECIDE (every rank's :class:`Flags`, one in-group
all-reduce, :func:`decide_group`). Drivers: :mod:`ftbridge.manager.replica`, :mod:`ftbridge.manager.outage`,
:mod:`ftbridge.manager.quorum_guard`. Protocol: docs/concepts.md, "The commit protocol"; invariants and
why a commit never splits the job: docs/design.md.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

# -- QUORUM ---------------------------------------------------------------------------------------------


def decide_ride(*, enabled: bool, has_last: bool, same_process_group: bool, last_committed: bool,
                rode_last: bool, last_ride_on: bool, lighthouse_answers: Optional[bool]) -> bool:
    """Whether this step reuses the last quorum instead of asking the lighthouse (group rank 0 decides).

    Rides only if ``enabled``, ``has_last``, ``same_process_group`` (torchft still holds it) and
    ``last_committed``; then, if ``rode_last``, as the last agreement said (``last_ride_on``), else only when
    ``lighthouse_answers`` is ``False`` (a request unanswered within the probe deadline; ``None``: no probe).
    """
    if not (enabled and has_last and same_process_group and last_committed):
        return False
    if rode_last:
        return last_ride_on
    return lighthouse_answers is False


class QuorumWait:
    """Waiting for one lighthouse call of group rank 0, started at monotonic ``started``: wait, leave it and ride (if
    ``may_ride``), or give up after ``deadline_s`` (> 0)."""

    WAIT, RIDE, EXPIRED = "wait", "ride", "expired"

    def __init__(self, *, started: float, deadline_s: float, may_ride: bool) -> None:
        if deadline_s <= 0:
            raise ValueError(f"deadline_s={deadline_s} must be positive")
        self.started, self.deadline_s, self.may_ride = started, deadline_s, may_ride

    def poll(self, now: float, lighthouse_answers: Optional[bool]) -> str:
        """At ``now`` (monotonic s): :attr:`RIDE` if riding is allowed and the lighthouse does not answer,
        :attr:`EXPIRED` past the deadline, else :attr:`WAIT`."""
        if self.may_ride and lighthouse_answers is False:
            return self.RIDE
        if now - self.started >= self.deadline_s:
            return self.EXPIRED
        return self.WAIT


# -- AGREE: one cross-replica all-reduce per step ------------------------------------------------------

DEAD_END_RUNS = 8
"""Runs of consecutive dead-end quorum ids a row carries (:attr:`View.dead_ends`); older runs are dropped. Why:
docs/design.md, "Continuity"."""

ROW = 28 + 2 * (DEAD_END_RUNS - 1)
"""float64 values per member in the agreement (:func:`encode_view`)."""
ROW_STEP = 7
"""Index of a member's step in its row."""
ROW_OK = 10
"""Index of a member's ``ok`` flag in its row."""
ROW_RIDING = 26
"""Index of a member's ``riding`` flag in its row."""
ROW_BEHIND = 27
"""Index of a member's :attr:`View.behind` in its row; its older dead-end runs follow."""


@dataclass(frozen=True)
class View:
    """What one member acts on in this step; every member's must match for a commit.

    Attributes:
        replica_group, quorum_id, step, plan: ids (a healing member's step is the donor's); ``plan``:
            ``config_digest + 1`` of the slot plan, 0 without slots.
        membership: :func:`membership_digest` of the quorum's replica ids.
        participants: the divisor it averages by; participating: its gradient counts (not healing).
        ok: no error recorded in this step and at least torchft's ``min_replica_size`` participants (below it
            torchft's ``should_commit`` refuses without an error); lighthouse_seen: the lighthouse answered at the
            step's start.
        guard: state fingerprint (16 hex digits) when the guard is due and it participates.
        certified, dead_ends, missed, committers: its quorum history (docs/design.md, "Continuity"): the
            newest quorum its agreement passed in (-1: none), runs ``(first, last)`` of later quorums it was in
            where none passed (newest first, at most :data:`DEAD_END_RUNS`), the newest quorum it missed (-1:
            none), and the members ok on the certifying step.
        empty: joined with nothing (:func:`ftbridge.heal.joined_empty`); num_groups: ``num_replica_groups``.
        borrowed: joined with nothing, healed since, and has not committed yet: it holds a peer's state, not its
            group's own history, so it cannot vouch for its group (:func:`judge`).
        holding: a lighthouse call its group left to ride is still in flight.
        riding: this member reuses the last quorum in this step (it did not get it from the lighthouse).
        behind: since a lighthouse restart, until its group commits: 1 + the newest step it missed before the restart
            (0: none); a quorum that does not hold the whole job commits only at a ``step`` of at least it.
    """

    replica_group: int
    quorum_id: int
    membership: str
    step: int
    participants: int
    participating: bool
    ok: bool
    lighthouse_seen: bool
    guard: Optional[str] = None
    certified: int = -1
    dead_ends: Tuple[Tuple[int, int], ...] = ()
    empty: bool = False
    num_groups: int = 0
    missed: int = -1
    committers: int = 0
    holding: bool = False
    plan: int = 0
    borrowed: bool = False
    riding: bool = False
    behind: int = 0


def membership_digest(replica_ids: Sequence[str]) -> str:
    """16 hex digits of SHA-256 over the sorted replica ids (each with torchft's per-process uuid)."""
    return hashlib.sha256("|".join(sorted(replica_ids)).encode()).hexdigest()[:16]


def _chunks(digest: str, what: str) -> List[float]:
    if len(digest) != 16:
        raise ValueError(f"{what} must be 16 hex digits, got {digest!r}")
    value = int(digest, 16)
    return [float((value >> (16 * i)) & 0xFFFF) for i in range(4)]


def _digest(chunks: Sequence[float]) -> str:
    return f"{sum(int(round(c)) << (16 * i) for i, c in enumerate(chunks)):016x}"


def encode_view(v: View) -> List[float]:
    """One member's agreement row of :data:`ROW` float64 values, exact: ``[1, group + 1, quorum id, membership x4, step,
    participants, participating, ok, lighthouse seen, guard present, guard x4, certified + 1, newest dead-end run (first
    + 1, last + 1), state, num groups, missed + 1, committers, holding, plan, riding, behind, older runs]`` (0 where
    none);
    state: 0 own, 1 empty, 2 borrowed.

    Raises:
        ValueError: a digest is not 16 hex digits, a number is outside ``[0, 2**53)``, or more than
            :data:`DEAD_END_RUNS` runs.
    """
    for name in ("replica_group", "quorum_id", "step", "participants", "plan", "behind"):
        if not 0 <= getattr(v, name) < 2**53:
            raise ValueError(f"agreement view: {name}={getattr(v, name)} must be in [0, 2**53)")
    if len(v.dead_ends) > DEAD_END_RUNS:
        raise ValueError(f"agreement view: {len(v.dead_ends)} dead-end runs, at most {DEAD_END_RUNS} fit a row")
    guard = [1.0, *_chunks(v.guard, "guard digest")] if v.guard is not None else [0.0] * 5
    runs = [float(x + 1) for run in v.dead_ends for x in run]
    runs += [0.0] * (2 * DEAD_END_RUNS - len(runs))
    return [1.0, float(v.replica_group + 1), float(v.quorum_id), *_chunks(v.membership, "membership digest"),
            float(v.step), float(v.participants), float(v.participating), float(v.ok), float(v.lighthouse_seen),
            *guard, float(v.certified + 1), *runs[:2], 1.0 if v.empty else 2.0 if v.borrowed else 0.0,
            float(v.num_groups),
            float(v.missed + 1), float(v.committers), float(v.holding), float(v.plan), float(v.riding),
            float(v.behind), *runs[2:]]


def id_runs(ids: Iterable[int], limit: int) -> Tuple[Tuple[int, int], ...]:
    """The newest ``limit`` runs of consecutive ids as ``(first, last)``, newest first (``id_runs({10, 12, 13}, 8) ==
    ((12, 13), (10, 10))``)."""
    runs: List[List[int]] = []
    for i in sorted(set(ids), reverse=True):
        if runs and runs[-1][0] == i + 1:
            runs[-1][0] = i
        elif len(runs) == limit:
            break
        else:
            runs.append([i, i])
    return tuple((first, last) for first, last in runs)


def dead_end_runs(row: Sequence[float]) -> Tuple[Tuple[int, int], ...]:
    """The dead-end runs ``(first, last)`` of one agreement row (:func:`encode_view`), newest first."""
    cells = [row[18], row[19], *row[ROW_BEHIND + 1:ROW]]
    return tuple((int(cells[i]) - 1, int(cells[i + 1]) - 1) for i in range(0, len(cells), 2) if cells[i])


@dataclass(frozen=True)
class GuardVerdict:
    """The divergence guard's majority judgement: ``digests`` (group -> fingerprint), the strict ``majority`` (``None``
    in a tie), the ``differing`` groups and the ``agreeing`` ones (heal sources)."""

    digests: Dict[int, str]
    majority: Optional[str]
    differing: Tuple[int, ...]
    agreeing: Tuple[int, ...]

    @property
    def ok(self) -> bool:
        """Every reporting member holds the same state."""
        return len(set(self.digests.values())) <= 1

    @property
    def tie(self) -> bool:
        """The members differ and no state is held by a strict majority."""
        return not self.ok and self.majority is None


def judge_guard(digests: Dict[int, str]) -> GuardVerdict:
    """Which groups differ from the state a strict majority holds; no group is the reference (pure)."""
    counts = Counter(digests.values())
    top = counts.most_common(1)[0] if counts else None
    majority = top[0] if top is not None and 2 * top[1] > len(digests) else None
    if majority is None:
        return GuardVerdict(dict(digests), None, (), ())
    return GuardVerdict(dict(digests), majority, tuple(sorted(g for g, d in digests.items() if d != majority)),
                        tuple(sorted(g for g, d in digests.items() if d == majority)))


@dataclass(frozen=True)
class Agreement:
    """One member's verdict on the summed agreement tensor (every member judges the same tensor).

    Attributes:
        consistent: every member present once, on one quorum, membership, step and divisor, with as many
            participants as the divisor.
        continuous: ``consistent`` and following the job's history (:func:`continuous`).
        commit: ``continuous`` and, in a riding step, every member ok.
        ride_on: ``commit``, and no member heard the lighthouse or one is :attr:`View.holding`.
        reason: why not ``commit``; guard: the guard's verdict, if fingerprints came.
        all_empty: ``consistent`` and every member joined empty.
        shared: every member reaches this verdict (the complete tensor, or this row missing).
    """

    consistent: bool
    commit: bool
    ride_on: bool
    reason: str
    guard: Optional[GuardVerdict] = None
    continuous: bool = False
    all_empty: bool = False
    shared: bool = False


def judge(rows: Sequence[Sequence[float]], own: Sequence[float], *, riding: bool) -> Agreement:
    """The verdict of one step's agreement (pure).

    Args:
        rows: the summed tensor, one row of :data:`ROW` per member (quorum replica rank); a row whose first
            value is not exactly 1 (missing or doubled) fails it.
        own: this member's row (:func:`encode_view`).
        riding: this member reuses the last quorum in this step. When any member rides (this one or a row's
            ``riding``), every member must also be ok: a member that got the quorum from the lighthouse judges by
            the riders' rule too, so no member commits a riding step that a rider discards believing nobody did.
    """
    if not rows:
        return Agreement(False, False, False, "no members")
    key = [float(x) for x in own[2:9]]  # quorum id, membership, step, participants
    for rank, row in enumerate(rows):
        if len(row) != ROW or row[0] != 1.0:
            return Agreement(False, False, False, f"member {rank} missing from the agreement")
        if [float(x) for x in row[2:9]] != key:
            return Agreement(False, False, False,
                             f"member {rank} (group {row[1] - 1:.0f}) is on quorum {row[2]:.0f} step {row[7]:.0f} "
                             f"averaging over {row[8]:.0f}; this member on quorum {key[0]:.0f} step {key[5]:.0f} "
                             f"over {key[6]:.0f} (or another membership)")
    counted = sum(1 for row in rows if row[9] == 1.0)
    if counted != int(key[6]):
        return Agreement(False, False, False, f"{counted} members participate but each averages over "
                                              f"{int(key[6])}: the members disagree on who heals")
    guard_rows = [row for row in rows if row[9] == 1.0 and row[12] == 1.0]
    guard = judge_guard({int(row[1]) - 1: _digest(row[13:17]) for row in guard_rows}) if guard_rows else None
    histories = [(int(row[17]) - 1, dead_end_runs(row), int(row[23])) for row in rows]
    empty = all(row[20] == 1.0 for row in rows)
    if any(row[21] != own[21] for row in rows):
        return Agreement(False, False, False, f"the members disagree on the job's number of replica groups "
                                              f"({sorted({int(row[21]) for row in rows})})")
    if any(row[25] != own[25] for row in rows):
        return Agreement(False, False, False, "the members train by different slot plans (FTBRIDGE_SLOTS, "
                                              "gradient_accumulation_steps, micro-batch or group size differ)")
    # Every group of the job is here, each by a member that trains this step on state of its own: nobody else
    # trained. A member that joined empty, heals now, or healed from a peer and has not committed since (a spare
    # that took the id, a restart) cannot vouch for its group: the id's old holder may live on, cut off, or have
    # died, with steps this quorum never saw.
    groups = {int(row[1]) - 1 for row in rows if row[9] == 1.0 and row[20] == 0.0}
    whole = own[21] > 0 and groups >= set(range(int(own[21])))
    missed = max(int(row[22]) - 1 for row in rows)
    behind = max(int(row[ROW_BEHIND]) for row in rows)
    if not whole and behind > int(key[5]):
        return Agreement(True, False, False, f"a member discarded step {behind - 1} before the lighthouse restarted, "
                                             "which others may have committed, and no member here holds it",
                         guard, all_empty=empty)
    gap = None if whole else continuous(int(key[0]), histories, missed)
    if gap is not None:
        why = (f"a member discarded a step of quorum {gap} that others may have committed, and no member here "
               "holds it" if gap == missed else
               f"quorum {int(key[0])} follows quorum {gap}, in which none of its members took part: others may "
               "have committed steps there")
        return Agreement(True, False, False, why, guard, all_empty=empty)
    if riding or any(row[ROW_RIDING] == 1.0 for row in rows):
        for rank, row in enumerate(rows):
            if row[ROW_OK] != 1.0:
                return Agreement(True, False, False, f"member {rank} recorded an error in this riding step", guard,
                                 True, empty)
    ride_on = not any(row[11] for row in rows) or any(row[24] for row in rows)
    return Agreement(True, True, ride_on, "", guard, True, empty)


def continuous(quorum_id: int, histories: Sequence[Tuple[int, Sequence[Tuple[int, int]], int]],
               missed: int = -1) -> Optional[int]:
    """The first earlier quorum id none of this quorum's members can account for, or ``None`` (pure; the rule:
    docs/design.md, "Continuity").

    Args:
        quorum_id: this quorum's id.
        histories: per member ``(certified, dead_ends, committers)`` as in :class:`View`.
        missed: the newest :attr:`View.missed` among the members (-1: none).
    """
    certified = [c for c, _, _ in histories if c >= 0]
    if missed > max(certified, default=-1):
        return missed
    if not certified:
        return None
    holders = [k for c, _, k in histories if c == max(certified)]
    if len(holders) >= max(holders):
        return None
    runs = sorted(run for _, member_runs, _ in histories for run in member_runs)
    want = max(certified) + 1
    for first, last in runs:
        if want >= quorum_id:
            break
        if first <= want <= last:
            want = last + 1
    return want if want < quorum_id else None


# -- DECIDE: one in-group exchange per step -----------------------------------------------------------

FLAGS = 15
"""float64 values per rank in the in-group exchange (:func:`encode_flags`)."""


@dataclass(frozen=True)
class Flags:
    """What one rank of a replica group brings to the group's decision.

    Attributes:
        step, errored: torchft's step; an error is recorded on this rank.
        agreement, ride_on: its agreement passed (:attr:`Agreement.commit`), and says ride on.
        healing, heal_ready: it heals in this step, and holds its complete heal state.
        guard_mismatch, guard_differs, guard_tie: some member differs; this group was outvoted; no majority.
        stop, gap_stop: it ends the group (no peer to heal from; past ``restart_peer_wait`` without continuity).
        fails_all: its agreement failed with a shared verdict: no group commits this step.
        store_unreachable: group rank 0's probe of the quorum's store failed (:mod:`~ftbridge.manager.stand_aside`).
        met: its agreement ran with every member (:attr:`Agreement.consistent`); only such steps count
            towards ``restart_peer_wait``.
    """

    step: int
    errored: bool
    agreement: bool
    ride_on: bool = False
    healing: bool = False
    heal_ready: bool = False
    guard_mismatch: bool = False
    guard_differs: bool = False
    guard_tie: bool = False
    stop: bool = False
    gap_stop: bool = False
    fails_all: bool = False
    store_unreachable: bool = False
    met: bool = True


def rank_flags(*, step: int, errored: bool, agreement: Optional[Agreement], healing: bool, heal_ready: bool,
               replica_group: int, stop: bool = False, gap_stop: bool = False,
               store_unreachable: bool = False) -> Flags:
    """This rank's :class:`Flags` (pure); ``agreement`` ``None`` (none made) counts as passed, ``replica_group`` names
    it to the guard."""
    g = agreement.guard if agreement is not None else None
    return Flags(step=step, errored=errored, agreement=agreement.commit if agreement is not None else True,
                 ride_on=bool(agreement and agreement.ride_on), healing=healing,
                 heal_ready=heal_ready, guard_mismatch=bool(g and not g.ok),
                 guard_differs=bool(g and replica_group in g.differing), guard_tie=bool(g and g.tie), stop=stop,
                 gap_stop=gap_stop,
                 fails_all=bool(agreement and agreement.shared and not agreement.commit),
                 store_unreachable=store_unreachable, met=agreement.consistent if agreement is not None else True)


def encode_flags(f: Flags) -> List[float]:
    """One rank's row of the in-group exchange, exact in float64: ``[1, step]`` then the boolean fields of
    :class:`Flags` in order."""
    return [1.0, float(f.step), float(f.errored), float(f.agreement), float(f.ride_on),
            float(f.healing), float(f.heal_ready), float(f.guard_mismatch), float(f.guard_differs),
            float(f.guard_tie), float(f.stop), float(f.gap_stop), float(f.fails_all), float(f.store_unreachable),
            float(f.met)]


@dataclass(frozen=True)
class GroupDecision:
    """The one decision of a replica group for this step, the same on every rank.

    Attributes:
        commit: the group votes to commit; reason: why not ("" when it does).
        drop_heal: the group heals but a rank lacks its state: nobody applies it.
        guard_mismatch, guard_differs, guard_tie, stop, gap_stop, store_unreachable: any rank's :class:`Flags`.
        ride_next: committed on an agreement that says ride on, on every rank.
        nobody_commits: a rank's agreement failed with a shared verdict: every group discards.
        agreed, met: every rank's agreement passed; ran with every member.
    """

    commit: bool
    drop_heal: bool
    guard_mismatch: bool
    guard_differs: bool
    guard_tie: bool
    ride_next: bool
    stop: bool
    gap_stop: bool
    reason: str
    nobody_commits: bool = False
    agreed: bool = False
    store_unreachable: bool = False
    met: bool = True


def decode_flags(row: Sequence[float]) -> Flags:
    """The :class:`Flags` of one :func:`encode_flags` row.

    Raises:
        ValueError: not exactly one rank's row (missing, or written twice into the sum).
    """
    if len(row) != FLAGS or row[0] != 1.0 or any(v not in (0.0, 1.0) for v in row[2:]):
        raise ValueError(f"in-group exchange: flags missing or doubled ({list(row)})")
    return Flags(int(row[1]), *(v == 1.0 for v in row[2:]))


def decide_group(rows: Sequence[Sequence[float]]) -> GroupDecision:
    """The replica group's decision from every rank's :func:`encode_flags` row (pure; same on every rank).

    Raises:
        ValueError: a row is missing or doubled; the caller must not guess a decision.
    """
    flags = []
    for rank, row in enumerate(rows):
        try:
            flags.append(decode_flags(row))
        except ValueError as exc:
            raise ValueError(f"rank {rank}: {exc}") from None
    healing = any(f.healing for f in flags)
    drop_heal = healing and not all(f.healing and f.heal_ready for f in flags)
    differs = any(f.guard_differs for f in flags)
    stop, gap_stop = any(f.stop for f in flags), any(f.gap_stop for f in flags)
    reasons = []
    if len({f.step for f in flags}) > 1:
        reasons.append(f"the ranks are on different steps {sorted({f.step for f in flags})}")
    if any(f.errored for f in flags):
        reasons.append("a rank recorded an error")
    if not all(f.agreement for f in flags):
        reasons.append("a rank's cross-replica agreement failed")
    if drop_heal:
        reasons.append("a rank of this group did not receive its heal state")
    if differs:
        reasons.append("the divergence guard outvoted this group's state")
    if stop or gap_stop:
        reasons.append("a rank of this group stops it")
    commit = not reasons
    tie = any(f.guard_tie for f in flags)
    return GroupDecision(commit, drop_heal, any(f.guard_mismatch for f in flags) or differs or tie, differs, tie,
                         commit and all(f.ride_on for f in flags), stop, gap_stop, "; ".join(reasons),
                         any(f.fails_all for f in flags), all(f.agreement for f in flags),
                         any(f.store_unreachable for f in flags), all(f.met for f in flags))

