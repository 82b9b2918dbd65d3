"""A deterministic simulation of ftbridge's commit protocol: replica groups, ranks, a lighthouse, links, a clock.

It drives the protocol's real code with fakes for everything it talks to:

* per rank, a real :class:`ftbridge.manager.outage.OutageRider` (the riding decision, shared with the group
  through a store, the last quorum, the agreement row and its verdict, the state after a commit) and a real
  :class:`ftbridge.manager.HealAgreement` (state, settle), over a fake torchft manager (:class:`RankTF`);
* the pure rules: :class:`~ftbridge.manager.commit.QuorumWait`, :func:`~ftbridge.manager.commit.rank_flags`,
  :func:`~ftbridge.manager.commit.decide_group` (the guard's majority inside ``judge``),
  :mod:`ftbridge.manager.quorum_rules` (lighthouse restarts, the reconfigure vote, the majority after a restart) and
  :func:`ftbridge.heal.joined_empty` and :func:`ftbridge.heal.restart_without_peer`.

One round is one step attempt of every group that runs; the clock counts rounds. What the fakes model:

* the lighthouse (:class:`SimLighthouse`): heartbeats, a quorum of the groups whose request reached it when
  every fresh group asked (or, after the join wait, more than half), a new id when the membership changes,
  the highest step and who heals; dead, hung (requests wait, nothing is answered), restarted empty;
* links: a group cut off from the lighthouse both ways or one way (its requests and heartbeats arrive, the
  answers do not), two groups whose collectives cannot reach each other, a rank whose all-reduce fails;
* groups: killed and restarted by torchrun (a new replica id, nothing to start from), slow for a round (it
  heartbeats but does not ask), hung (no heartbeat either), a heal fetch that fails on one rank, the
  request of a try it left delivered late with its old step (a hung lighthouse reading its socket), a
  corrupted update;
* warm spares (:mod:`ftbridge.spare`): a spare stands by until the lighthouse has dropped a group it heard of
  while another group lives (:func:`~ftbridge.spare.vacancies`' rule), then takes that group's id with nothing
  to start from, while the group it replaces may still run (cut off or hung); a member that heals into a
  quorum where another holds its id leaves (:func:`~ftbridge.spare.must_leave`);
* a cross-replica collective (one per group rank) completes only when every member of its process group
  runs the round on that same process group and every link between them holds; a rank after an error
  leaves its later collectives out, as torchft does;
* slots (``Sim(slots=True)``, FTBRIDGE_SLOTS): each rank takes its group rank 0's plan before its gradient
  all-reduces (:func:`ftbridge.slots.steps.group_plan`, by the real
  :func:`~ftbridge.slots.steps.participants_of`); a step in which a member heals, or whose plan rank 0 cannot
  make, is discarded on every rank of every member by :class:`~ftbridge.slots.steps.StepNotCovered`, a
  :class:`~ftbridge.manager.heal_agreement.DiscardStep`: the rank's collectives and its agreement row are left
  out, and a heal received in the step still applies.

Parameters are hashes: a commit applies ``H(params, contributions, divisor)``, so two groups that commit a
step with different averages hold different parameters. :meth:`Sim.check` asserts the invariants after
every round; :class:`Revert` switches one fix off, to show the simulation catches it.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
from dataclasses import dataclass
from datetime import timedelta
from types import SimpleNamespace
from typing import Any, Dict, FrozenSet, List, Optional, Set, Tuple

from ftbridge.guard import DivergenceGuard, ReplicaDivergenceError
from ftbridge.heal import joined_empty, restart_without_peer
from ftbridge.manager.commit import (
    ROW_BEHIND,
    ROW_RIDING,
    Agreement,
    QuorumWait,
    continuous,
    decide_group,
    encode_flags,
    id_runs,
    rank_flags,
)
from ftbridge.manager.heal_agreement import HealAgreement
from ftbridge.manager.lighthouse_status import replica_group_of
from ftbridge.manager.outage import OutageRider, QuorumTimeout
from ftbridge.manager.quorum_rules import (
    VOTE_SKIP_WINDOW_S,
    QuorumSeen,
    RestartMajority,
    decide_reconfigure,
    detect_lighthouse_restart,
    heals_backwards,
    vote_needed,
)
from ftbridge.manager.stand_aside import StandAside, longest_pause
from ftbridge.slots.steps import StepNotCovered, participants_of
from ftbridge.spare import choose_group, must_leave, vacancies

logging.getLogger("ftbridge.manager.outage").setLevel(logging.ERROR)
logging.getLogger("ftbridge.manager.heal_agreement").setLevel(logging.ERROR)

HEARTBEAT_TIMEOUT = 2
"""Rounds without a heartbeat after which the lighthouse holds a group dead."""
JOIN_WAIT = 1
"""Rounds the lighthouse waits for fresh groups that did not ask before it forms a quorum without them."""
QUORUM_TIMEOUT = 6
"""Rounds a lighthouse call may stay unanswered before the rank gives up (QuorumWait's deadline)."""
TRY_ROUNDS = 2
"""Rounds one try of a lighthouse call lasts (``quorum_timeout / tries``): a try the group left and nobody
answered by then ends with torchft's ``TimeoutError``, and the group's members stop holding the ride for it."""
RESTART_PEER_WAIT = 4
"""Rounds a restarted group with nothing waits alone for a peer (``restart_peer_wait``)."""
MAJORITY_WAIT = RESTART_PEER_WAIT
"""Rounds a quorum after a lighthouse restart waits for a majority of the groups before it (``restart_peer_wait``
too, as in the driver)."""
STAND_ASIDE = HEARTBEAT_TIMEOUT + 2
"""Rounds of a group's first stand-aside (:class:`ftbridge.manager.commit.StandAside`'s ``base_s``)."""


@dataclass(frozen=True)
class Faults:
    """What is wrong during one round, by process key (``(key, rank)`` for rank faults): a group started with the
    job is keyed by its replica group id, spare ``k`` by ``groups + k`` (whichever id it holds)."""

    lighthouse: str = "up"
    """``up``, ``dead`` (refuses) or ``hung`` (accepts, answers nothing; requests wait)."""
    restart_lighthouse: bool = False
    cut_lh: FrozenSet[int] = frozenset()
    oneway_lh: FrozenSet[int] = frozenset()
    cut_peer: FrozenSet[FrozenSet[int]] = frozenset()
    slow: FrozenSet[int] = frozenset()
    hang: FrozenSet[int] = frozenset()
    kill: FrozenSet[int] = frozenset()
    restart: FrozenSet[int] = frozenset()
    rank_error: FrozenSet[Tuple[int, int]] = frozenset()
    heal_fail: FrozenSet[Tuple[int, int]] = frozenset()
    crash: FrozenSet[int] = frozenset()
    """The group dies right after its agreement, before its decision: the others' agreements counted its row."""
    late_error: FrozenSet[Tuple[int, int]] = frozenset()
    """An error recorded on the rank after its gradient all-reduces ran (the peer watch finding the process was
    frozen and left out, or any check of the step that fails late): its row still joins the agreement."""
    stale: FrozenSet[int] = frozenset()
    corrupt: FrozenSet[int] = frozenset()
    lost_answer: FrozenSet[Tuple[int, int]] = frozenset()
    """Group rank ``r >= 1`` of the group loses its copy of the round's answer its rank 0 got (paused past its
    try's deadline with the try in flight): the real ``OutageRider._lost_answer`` runs on it."""
    timed_out: FrozenSet[int] = frozenset()
    """The group's try times out as the lighthouse issues the round's quorum to it: the answer goes nowhere, and
    its ranks read the lighthouse's last quorum (the real ``UnseenQuorums.look``) before asking again."""

    def quiet(self) -> bool:
        """Nothing is wrong this round."""
        return self == Faults()


@dataclass
class Revert:
    """Fixes switched off, one at a time, to show the simulation catches each."""

    participation_view: bool = False
    """The agreement ignores who participates and the divisor (riders and members disagreeing on who heals)."""
    group_decision: bool = False
    """Each rank decides on its own flags instead of the group's exchange."""
    guard_primary: bool = False
    """The guard takes the quorum's primary (replica rank 0) as the truth instead of the majority."""
    restart_alone: bool = False
    """A restarted group with nothing trains alone from step 0 after the wait instead of stopping."""
    quorum_deadline: bool = False
    """A lighthouse call that never answers is waited for forever (no deadline, no ride)."""
    continuity: bool = False
    """A quorum that follows quorums none of its members took part in commits like any other."""
    unseen: bool = False
    """A quorum issued to a timed-out try is not looked for in the lighthouse's status."""
    majority_on_sight: bool = False
    """After a lighthouse restart, seeing a quorum that holds most groups of the one before ends the requirement,
    even if nothing commits there."""
    majority_clock: bool = False
    """After a lighthouse restart, the wait for a majority of the groups before it counts from the restart, through
    time the lighthouse did not answer and past quorums that held the majority (the groups could not come back, or
    did)."""
    certify_on_agreement: bool = False
    """A member certifies a quorum whose agreement passed even if its group discards there (a healer whose heal
    did not apply, a group the guard outvoted): it vouches for a history it does not hold."""
    agreement_watch: bool = False
    """The peer watch cuts the agreement's wait short when the lighthouse holds a member dead (that member, cut
    off from the lighthouse but not from its peers, completes the agreement and commits)."""
    stand_aside: bool = False
    """A group whose rank 0 cannot reach the quorum's store stays in every quorum (it never stands aside)."""
    newest_dead_end_run: bool = False
    """A member's row carries only its newest run of consecutive dead-end quorum ids: a dead end older than a
    quorum it was not in (a joiner's quorum alone) is never vouched for, and every later quorum is discarded."""
    spare_holds_state: bool = False
    """A spare that took a group's id counts as holding the job's state (it is not ``empty``), like a group at the
    job's start: alone in a quorum, it trains a second model from step 0."""
    healed_joiner_vouches: bool = False
    """A joiner that healed from a peer vouches for the group id it holds before it has committed (it is not
    ``borrowed``): with every id present, a quorum behind that id's dead holder counts as the whole job."""
    riding_row: bool = False
    """A member's row does not say that it rides: a member that got the same quorum from the lighthouse commits a
    step a rider discards, by the lighthouse rule, while the rider believes nobody did."""
    heal_backwards: bool = False
    """A group that a quorum ranks behind a peer by a late request of a call it left (an older step) heals to the
    peer's earlier step, over steps it committed since."""
    behind_across_restart: bool = False
    """A member's row does not carry the step it missed across a lighthouse restart: when the only holders of that
    step die as the lighthouse restarts, the survivors train it again."""


def H(*parts: Any) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


class Store:
    """A replica group's TCPStore (single-threaded: rank 0 runs first)."""

    def __init__(self) -> None:
        self.kv: Dict[str, bytes] = {}

    def set(self, k: str, v: Any) -> None:
        self.kv[k] = v if isinstance(v, bytes) else str(v).encode()

    def delete_key(self, k: str) -> None:
        self.kv.pop(k, None)

    def wait(self, keys: List[str], timeout: Any) -> None:
        missing = [k for k in keys if k not in self.kv]
        if missing:
            raise TimeoutError(f"store keys {missing} not set")

    def get(self, k: str) -> bytes:
        return self.kv[k]


class PGState:
    """The rank's cross-replica process group as torchft holds it."""

    def __init__(self) -> None:
        self.ident: Optional[Tuple[Any, ...]] = None  # (lighthouse epoch, quorum id, members, generation)

    def errored(self) -> None:
        return None


class RankTF:
    """The torchft ``Manager`` fields and methods the drivers read, for one rank."""

    def __init__(self, store: Store) -> None:
        self._quorum_id = -1
        self._pg = PGState()
        self._store = store
        self.step = 0
        self.batches = 0
        self.error: Optional[Exception] = None
        self.participants = 0
        self.participating = False
        self._healing = False
        self._pending_state_dict: Optional[Dict[str, Any]] = None

    def errored(self) -> Optional[Exception]:
        return self.error

    def report_error(self, e: Exception) -> None:
        self.error = self.error or e

    def current_step(self) -> int:
        return self.step

    def num_participants(self) -> int:
        return self.participants

    def is_participating(self) -> bool:
        return self.participating

    def state_dict(self) -> Dict[str, int]:
        return {"step": self.step, "batches_committed": self.batches}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.step, self.batches = state["step"], state["batches_committed"]


class SimRank:
    def __init__(self, group: "SimGroup", rank: int, ride: bool) -> None:
        self.store = group.store
        self.tf = RankTF(group.store)
        self.rider = OutageRider(self.tf, enabled=ride, lighthouse="sim", group_rank=rank, group_size=group.size,
                                 decision_timeout=timedelta(seconds=1), monitor=group.monitor,
                                 replica_group_id=group.gid, num_groups=group.num_groups,
                                 gap_wait=timedelta(seconds=group.peer_wait),
                                 clock=group.clock)
        self.heal = HealAgreement(self.tf)
        self.guard = DivergenceGuard(None, replica_group_id=group.gid, every=group.guard_every, action="heal",
                                     on_tie="stop", events=_NoEvents())
        self.params = H("init")
        self.contribution: Optional[Tuple[Any, ...]] = None
        self.healed_from: Optional[str] = None
        self.agreement: Optional[Agreement] = None
        self.store_unreachable = False  # this round's configure found the quorum's store silent (group rank 0)
        self.aside = StandAside(base_s=float(STAND_ASIDE), max_s=longest_pause(STAND_ASIDE, group.peer_wait))


class _NoEvents:
    def write(self, **kw: Any) -> None:
        pass


class Monitor:
    """The lighthouse monitor of one group: a probe started in a round answers in the next one (at a step's start
    the real monitor returns what a probe started earlier saw, or nothing); a call in flight sees this round's."""

    def __init__(self) -> None:
        self.truth = True  # whether a probe would get an answer this round
        self._last: Optional[bool] = None  # what a probe started last round saw
        self._probed = False

    def answers(self, since: float) -> Optional[bool]:
        self._probed = True
        return self._last

    def during_call(self) -> bool:
        self._probed = True
        return self.truth

    def next_round(self, truth: bool) -> None:
        self._last = self.truth if self._probed else None
        self._probed, self.truth = False, truth


@dataclass
class Quorum:
    quorum_id: int
    replica_ids: List[str]
    steps: Dict[str, int]
    epoch: int
    max_step: int = 0

    def __post_init__(self) -> None:
        self.max_step = max(self.steps.values())


class SimGroup:
    def __init__(self, gid: int, size: int, ride: bool, guard_every: int, clock: Any, num_groups: int,
                 peer_wait: int = RESTART_PEER_WAIT, spare: bool = False, key: Optional[int] = None) -> None:
        self.peer_wait = peer_wait  # restart_peer_wait in rounds: also the majority wait after a lighthouse restart
        self.gid, self.size, self.ride, self.guard_every, self.clock = gid, size, ride, guard_every, clock
        self.key = gid if key is None else key  # the process (faults name it): gid, or groups + k for spare k
        self.spare = spare  # started as a warm spare: it stands by until it takes a vacant group's id
        self.first_seen: Dict[int, float] = {}  # a standing-by spare: vacant group id -> round first seen
        self.num_groups = num_groups
        self.launch = 0
        self.alive = not spare
        self.exit_reason = "standby" if spare else ""
        self.start()

    def start(self) -> None:
        self.store = Store()
        self.monitor = Monitor()
        self.ranks = [SimRank(self, r, self.ride) for r in range(self.size)]
        self.asking: Optional[QuorumWait] = None
        self.request_step: Optional[int] = None
        self.stale_step: Optional[int] = None
        self.seen: Optional[QuorumSeen] = None
        self.voted: Optional[Tuple[int, Tuple[str, ...]]] = None  # the quorum of its last complete reconfigure vote
        self.last_quorum_round: Optional[int] = None  # the round its last quorum call returned
        self.rode_since = False  # rode on its last quorum since then
        self.votes_skipped = 0
        self.majority = RestartMajority(self.peer_wait)
        self.asked_for = 0  # rounds the group's last answered lighthouse call waited
        self.restart_round = 0  # round of the lighthouse restart whose majority the group waits for
        self.started_round = 0
        self.heals = 0
        self.committed_once = False  # this launch committed a step (the engine's _committed_since_launch)
        self.commit_failures = 0
        self.aside_until = 0  # the group stands aside (no heartbeat, no request) until this round
        self.asides: List[Tuple[int, int]] = []  # (round it stood aside, round it is back), this launch
        self.lost_answers: Set[int] = set()  # quorum ids issued to this group whose answer it never got
        self.left_calls: List[List[Any]] = []  # [call the group left, its quorum once formed, round it was left]:
        # answered once the link carries answers again, or ended by its try's deadline (TRY_ROUNDS)

    @property
    def replica_id(self) -> str:
        return f"replica_group_{self.gid}:{'spare' if self.spare else 'launch'}{self.key}.{self.launch}"


class SimLighthouse:
    """torchft 0.2's ``quorum_compute`` rules, per round: a fast quorum when every member of the last quorum asks;
    otherwise at least ``min_replicas`` askers, more than half of the heartbeating groups, and every heartbeating
    group asked or the join wait passed. The id goes up when the membership changes or a member reports failed
    commits (which makes every member rebuild its process group)."""

    def __init__(self, min_replicas: int) -> None:
        self.min_replicas = min_replicas
        self.epoch = 0
        self.restart()

    def restart(self) -> None:
        self.epoch += 1
        self.quorum_id = 0
        self.members: Tuple[str, ...] = ()
        self.beats: Dict[str, int] = {}
        self.first_asked: Optional[int] = None

    def form(self, now: int, requests: Dict[str, Tuple[int, int]]) -> Optional[Quorum]:
        """The quorum of this round from ``{replica id: (step, commit failures)}``, or ``None``."""
        for rid in requests:
            self.beats[rid] = now  # a request is a heartbeat too
        healthy = {r for r, t in self.beats.items() if now - t < HEARTBEAT_TIMEOUT}
        asked = {r: v for r, v in requests.items() if r in healthy}
        if not asked:
            self.first_asked = None
            return None
        if self.first_asked is None:
            self.first_asked = now
        fast = bool(self.members) and set(self.members) <= set(asked)
        if not fast:
            if len(asked) < self.min_replicas or len(asked) <= len(healthy) // 2:
                return None
            if len(asked) < len(healthy) and now - self.first_asked < JOIN_WAIT:
                return None
        members = tuple(sorted(asked))
        if members != self.members or any(failures > 0 for _, failures in asked.values()):
            self.quorum_id += 1
        self.members, self.first_asked = members, None
        return Quorum(self.quorum_id, list(members), {r: step for r, (step, _) in asked.items()}, self.epoch)


@dataclass
class Record:
    """One group's outcome of one round."""

    group: int
    launch: int
    key: int
    empty: bool
    """The process holds nothing of the job's state: restarted or a spare, and it has not healed or committed."""
    step_before: int
    committed: bool
    participants: int
    params: str
    rode: bool


class Sim:
    """``groups`` replica groups of ``size`` ranks each, riding on or off, under a schedule of :class:`Faults`;
    ``slots``: the job trains with slots (:meth:`_slot_plan`)."""

    def __init__(self, groups: int, size: int, *, ride: bool = True, guard_every: int = 0, min_replicas: int = 1,
                 revert: Optional[Revert] = None, peer_wait: int = RESTART_PEER_WAIT, spares: int = 0,
                 slots: bool = False) -> None:
        self.groups = [SimGroup(g, size, ride, guard_every, lambda: float(self.now), groups, peer_wait)
                       for g in range(groups)]
        self.groups += [SimGroup(-1, size, ride, guard_every, lambda: float(self.now), groups, peer_wait, spare=True,
                                 key=groups + k) for k in range(spares)]
        self.lighthouse = SimLighthouse(min_replicas)
        self.guard_every = guard_every
        self.slots = slots
        self.revert = revert or Revert()
        self.now = 0
        self.commits: Dict[int, str] = {}  # step -> parameters after committing it (the first clean committer's)
        self.parent: Dict[str, str] = {}  # parameters -> the parameters they were updated from
        self.history: List[List[Record]] = []
        self.tainted: Set[str] = set()  # parameters that descend from a corrupted update
        self.faults = Faults()
        self._stepping: Set[int] = set()

    def group(self, replica_id: str) -> Optional[SimGroup]:
        return next((g for g in self.groups if g.replica_id == replica_id and g.alive), None)

    # -- one round ---------------------------------------------------------------------------------------
    def round(self, faults: Faults) -> List[Record]:
        """One step attempt of every group that runs, under ``faults``; the invariants are checked after it."""
        self.now += 1
        self.faults = f = faults
        lh = self.lighthouse
        if f.restart_lighthouse:
            lh.restart()
        for g in self.groups:
            if g.key in f.kill and (g.alive or g.exit_reason == "standby"):
                g.alive, g.exit_reason = False, "killed"
            elif g.key in f.restart and not g.alive and g.exit_reason == "killed" and g.gid >= 0:
                g.alive, g.exit_reason = True, ""
                g.launch += 1
                g.start()
                g.started_round = self.now
        self._spares_take_vacancies()
        runs = [g for g in self.groups if g.alive and g.key not in f.hang and g.aside_until <= self.now]
        for g in runs:  # heartbeats travel group -> lighthouse (a one-way cut lets them through)
            if f.lighthouse == "up" and g.key not in f.cut_lh:
                lh.beats[g.replica_id] = self.now
            g.monitor.next_round(f.lighthouse == "up" and g.key not in f.cut_lh and g.key not in f.oneway_lh)
        for g in runs:  # the answers of calls a group left arrive once its link carries them again
            if f.lighthouse == "up" and g.key not in f.cut_lh and g.key not in f.oneway_lh:
                for call, q, _ in g.left_calls:
                    if q is not None:
                        call.set_result(_Result(q, g.replica_id))
                g.left_calls = [c for c in g.left_calls if c[1] is None]
            for call, q, left in g.left_calls:  # a try nobody answered ends at its deadline
                if q is None and self.now - left >= TRY_ROUNDS:
                    call.set_exception(TimeoutError("Timeout expired"))
            g.left_calls = [c for c in g.left_calls if not c[0].done()]
        results = self._quorum([g for g in runs if g.key not in f.slow])
        stepping = [g for g in self.groups if g.key in results and g.alive]
        self._stepping = {g.key for g in stepping}
        owns = {g.key: self._own_rebuild(g, results[g.key]) for g in stepping if results[g.key] != "ride"}
        for g in stepping:
            self._apply_quorum(g, results[g.key], owns)
        stepping = [g for g in stepping if g.alive]  # a holder of a duplicated id left (must_leave)
        self._stepping = {g.key for g in stepping}
        donors = {g.replica_id: g.ranks[0].params for g in stepping}
        steps = {g.replica_id: g.ranks[0].tf.step for g in stepping}
        for g in stepping:
            self._fetch_heal(g, donors, steps)
            if self.slots:
                self._slot_plan(g)
        self._gradients(stepping)
        self._agree(stepping)
        for g in stepping:
            if g.key in f.crash:
                g.alive, g.exit_reason = False, "killed"
        records = [self._decide_and_commit(g) for g in stepping if g.alive]
        self.history.append(records)
        self.check(records)
        return records

    def _spares_take_vacancies(self) -> None:
        """Each standing-by spare that reads the lighthouse this round takes a vacant group id by the real rules
        (:func:`ftbridge.spare.vacancies`: heard of, every heartbeat stale, while another group is fresh;
        :func:`ftbridge.spare.choose_group`: spare ``k`` waits ``k`` rounds; no ``VACANT_FOR_S``, which guards
        against heartbeats late by a starved thread, and heartbeats here are never late). It starts with
        nothing."""
        f, lh = self.faults, self.lighthouse
        for g in self.groups:
            if g.exit_reason != "standby" or f.lighthouse != "up" or g.key in f.cut_lh | f.oneway_lh | f.hang:
                continue
            beats = [(replica_group_of(rid), self.now - t) for rid, t in lh.beats.items()]
            fresh = {gid for gid, age in beats if gid is not None and age < HEARTBEAT_TIMEOUT}
            vacant = vacancies(fresh, {gid for gid, _ in beats if gid is not None}, g.num_groups)
            g.first_seen = {gid: g.first_seen.get(gid, float(self.now)) for gid in vacant}
            take = choose_group(vacant, g.first_seen, float(self.now), g.key - g.num_groups, stagger_s=1.0,
                                vacant_for_s=0.0)
            if take is None:
                continue
            g.gid, g.alive, g.exit_reason = take, True, ""
            g.start()  # its ranks, rider and guard under the id it takes
            g.started_round = self.now
            lh.beats[g.replica_id] = self.now  # it heartbeats from its join: the next spare sees the id held

    def _quorum(self, runs: List[SimGroup]) -> Dict[int, Any]:
        """QUORUM: ride, or ask the lighthouse and wait; returns {group: quorum or 'ride'} for the groups that step."""
        f, out = self.faults, {}
        requests: Dict[str, Tuple[int, int]] = {}
        for g in runs:
            if g.asking is None:
                reused = [r.rider.reuse() for r in g.ranks]  # rank 0 first: the others read its decision
                if reused[0] is not None:
                    out[g.key] = "ride"
                    g.rode_since = True
                    continue
                g.asking = QuorumWait(started=float(self.now), deadline_s=float(QUORUM_TIMEOUT),
                                      may_ride=g.ranks[0].rider.may_ride())
                g.request_step = g.ranks[0].tf.step
            if f.lighthouse != "dead" and g.key not in f.cut_lh:
                requests[g.replica_id] = (g.request_step, g.commit_failures)
        for g in self.groups:  # a left try's request with its old step, arriving last
            if g.key in f.stale and g.alive and g.stale_step is not None and f.lighthouse != "dead":
                requests[g.replica_id] = (g.stale_step, 0)
                g.stale_step = None
        q = self.lighthouse.form(self.now, requests) if f.lighthouse == "up" else None
        for g in self.groups:  # a stale request answered: the answer goes to the call the group left
            if q is not None and g.asking is None and g.replica_id in q.replica_ids and g.left_calls:
                g.left_calls[-1][1] = q
        for g in runs:
            if g.asking is None:
                continue
            lost = None
            if q is not None and g.replica_id in q.replica_ids:
                if g.key not in f.oneway_lh | f.timed_out:
                    g.asked_for = self.now - int(g.asking.started)
                    g.asking, out[g.key] = None, q
                    continue
                if g.key in f.oneway_lh:
                    g.stale_step = g.request_step  # answered, but the answer is lost on the way back
                    g.lost_answers.add(q.quorum_id)
                    lost = q
                elif not self.revert.unseen:  # the try timed out: its ranks read the lighthouse's last quorum
                    self._look(g)

            action = g.asking.poll(float(self.now), g.monitor.during_call())
            if self.revert.quorum_deadline and action != QuorumWait.RIDE:
                action = QuorumWait.WAIT
            if action == QuorumWait.RIDE:
                g.stale_step = g.request_step  # the left try's request may still reach the lighthouse
                call: concurrent.futures.Future = concurrent.futures.Future()
                for r in g.ranks:
                    r.rider._left(call)  # the call's answer, if it ever comes, is a quorum the group never joined
                    r.rider.leave_call()
                g.left_calls.append([call, lost, self.now])
                g.asking, out[g.key] = None, "ride"
            elif action == QuorumWait.EXPIRED:
                g.alive, g.exit_reason = False, "QuorumTimeout"
        return out

    def _look(self, g: SimGroup) -> None:
        """Every rank of ``g`` reads the lighthouse's last quorum after a timed-out try (``UnseenQuorums.look``)."""
        lh = self.lighthouse
        status = SimpleNamespace(previous_quorum_id=lh.quorum_id,
                                 members=[SimpleNamespace(replica_id=rid) for rid in lh.members])
        for r in g.ranks:
            last = r.rider.last
            r.rider.unseen._me, r.rider.unseen._me_of = g.replica_id, None
            r.rider.unseen._fetch = lambda address, timeout_s: status
            r.rider.unseen.look(None if last is None else last.quorum_id, None if last is None else last.quorum_id)

    def _own_rebuild(self, g: SimGroup, q: "Quorum") -> Tuple[bool, bool, bool]:
        """``(restarted, own vote, votes)`` of a member before it applies ``q`` (the quorum guard's rules): a
        round is a step, a call answered in the round after the previous one is prompt (:func:`vote_needed`)."""
        restarted = detect_lighthouse_restart(g.seen, q.quorum_id, q.replica_ids)
        own = restarted or q.quorum_id != g.ranks[0].tf._quorum_id
        prompt = g.last_quorum_round == self.now - 1 and not g.rode_since
        votes = vote_needed(own, g.voted == (q.quorum_id, tuple(sorted(q.replica_ids))), g.rode_since,
                            0.0 if prompt else VOTE_SKIP_WINDOW_S, 0.0, g.commit_failures)
        g.last_quorum_round, g.rode_since = self.now, False
        g.votes_skipped += not votes
        return restarted, own, votes

    def _apply_quorum(self, g: SimGroup, result: Any, owns: Dict[int, Tuple[bool, bool]]) -> None:
        """What torchft and the quorum guard do with this step's quorum on each rank of ``g``."""
        for r in g.ranks:
            r.tf.error, r.tf._healing, r.tf._pending_state_dict, r.healed_from = None, False, None, None
            r.agreement = None
        if result == "ride":
            for r in g.ranks:
                r.tf.participants, r.tf.participating = r.rider.last.world_size, True
            return
        q: Quorum = result
        restarted, own, voting = owns[g.key]
        before = g.ranks[0].rider.certified_members()
        if restarted:
            if g.majority.pending is None:
                g.restart_round = self.now
            g.majority.restarted(before or (g.seen.members if g.seen is not None else ()), self.now)
        if g.asked_for >= TRY_ROUNDS and not self.revert.majority_clock:  # a try went unanswered (the guard's rule)
            g.majority.unanswered(self.now)
        g.seen = QuorumSeen(q.quorum_id, tuple(sorted(q.replica_ids)))
        votes = [owns[m.key][1] for m in map(self.group, q.replica_ids)
                 if m is not None and m.key in owns and owns[m.key][2]]
        complete = len(votes) == len(q.replica_ids)
        rebuild = decide_reconfigure(own, votes if complete else None) if voting else False
        if voting:
            g.voted = (q.quorum_id, tuple(sorted(q.replica_ids))) if complete else None
        at_max = [m for m in q.replica_ids if q.steps[m] == q.max_step]
        heal = q.steps[g.replica_id] < q.max_step
        backwards = heal and heals_backwards(g.ranks[0].tf.step, q.max_step) and not self.revert.heal_backwards
        heal &= not backwards  # the quorum guard refuses it (HealBackwards) before ReplicaManager._on_quorum
        if must_leave(q.replica_ids, g.gid, heal, g.replica_id, len(q.replica_ids) - len(at_max)):
            g.alive, g.exit_reason = False, "DuplicateReplicaGroup"  # before torchft heals (ReplicaManager._on_quorum)
            return
        for i, r in enumerate(g.ranks):
            if i > 0 and (g.key, i) in self.faults.lost_answer:
                try:
                    r.rider._lost_answer(TimeoutError("Timeout expired"), OutageRider._asked(_Result(q, g.replica_id)))
                except QuorumTimeout:
                    g.alive, g.exit_reason = False, "QuorumTimeout"
                continue  # torchft keeps this rank's last quorum and process group
            if rebuild:
                r.tf._quorum_id = q.quorum_id
                r.tf._pg.ident = (q.epoch, q.quorum_id, tuple(q.replica_ids), self.now)
                store = self.group(at_max[0])  # torchft: group rank 0's store is the first member at the max step
                if i == 0 and store is not None and frozenset((g.key, store.key)) in self.faults.cut_peer:
                    r.store_unreachable = g.majority.pending is None  # the driver's rule: not while a
                    # majority after a lighthouse restart is pending
                    r.tf.report_error(RuntimeError("the quorum's store did not answer"))
            r.rider.remember(_Result(q, g.replica_id), q.replica_ids)
            r.tf.participants, r.tf.participating = len(at_max), g.replica_id in at_max
            if backwards:
                r.tf.report_error(RuntimeError("the quorum would heal this group back to an earlier step"))
            if heal:
                r.tf._healing, r.healed_from = True, at_max[0]
        if self.revert.majority_clock and g.majority.pending is not None:  # the wait counted from the restart
            g.majority.pending = (g.majority.pending[0], g.restart_round)
        if not g.majority.lacks(q.replica_ids, self.now):
            if self.revert.majority_on_sight:
                g.majority.committed()
        else:
            for r in g.ranks:
                r.tf.report_error(RuntimeError("no majority of the groups after a lighthouse restart"))

    def _fetch_heal(self, g: SimGroup, donors: Dict[str, str], steps: Dict[str, int]) -> None:
        for i, r in enumerate(g.ranks):
            tf = r.tf
            if not tf._healing:
                continue
            src = r.healed_from or ""
            cut = self.group(src) is not None and frozenset((g.key, self.group(src).key)) in self.faults.cut_peer
            if src not in donors or (g.key, i) in self.faults.heal_fail or cut:
                tf.report_error(RuntimeError("heal fetch failed"))
                continue
            tf._pending_state_dict = {"params": donors[src], "torchft": {"step": steps[src], "batches_committed": 0}}
            tf.load_state_dict(tf._pending_state_dict["torchft"])  # torchft takes the donor's counters at once

    def _slot_plan(self, g: SimGroup) -> None:
        """:func:`ftbridge.slots.steps.group_plan` on every rank of ``g``, after its quorum and heal fetch, before its
        gradient all-reduces: each rank's row (the step's quorum usable by
        :func:`~ftbridge.slots.steps.participants_of`, every member taking part, no error recorded yet; the groups
        present) is compared with group rank 0's, which every rank takes. A rank whose row differs, whose rank 0's
        says the step cannot be covered, or that leaves this group out records
        :class:`~ftbridge.slots.steps.StepNotCovered`, unless it has an error already."""
        rows = []
        for r in g.ranks:
            last = r.rider.last
            members = tuple(last.result.replica_ids) if last is not None else ()
            present, why = participants_of(members, bool(members) and r.tf.participants == len(members),
                                           g.num_groups)
            if not why and r.tf.error is not None:
                why = "an error is already recorded in this step"
            rows.append((why, [0.0 if why else 1.0] + [1.0 if k in present else 0.0 for k in range(g.num_groups)]))
        decided = rows[0][1]
        for r, (why, row) in zip(g.ranks, rows):
            if r.tf.error is not None:
                continue
            if row != decided:
                r.tf.report_error(StepNotCovered("this rank's quorum differs from its group rank 0's"))
            elif decided[0] != 1.0:
                r.tf.report_error(StepNotCovered(why or "group rank 0 found the step's quorum unusable"))
            elif decided[1 + g.gid] != 1.0:
                r.tf.report_error(StepNotCovered(f"replica group {g.gid} is not among the step's participants"))

    def _pairs(self, g: SimGroup, rank: int, *, skip_errored: bool) -> bool:
        """Whether group rank ``rank``'s cross-replica collective of this round completes for ``g``."""
        f, ident = self.faults, g.ranks[rank].tf._pg.ident
        if ident is None:
            return False
        for rid in ident[2]:
            other = self.group(rid)
            if other is None or other.key not in self._stepping or other.ranks[rank].tf._pg.ident != ident:
                return False
            if skip_errored and other.ranks[rank].tf.error is not None:
                return False  # torchft issues nothing after an error
            if (other.key, rank) in f.rank_error or frozenset((g.key, other.key)) in f.cut_peer:
                return False
        return True

    def _gradients(self, stepping: List[SimGroup]) -> None:
        """The gradient all-reduce of every rank: what it contributes and divides by, or an error."""
        ok = {(g.key, i): self._pairs(g, i, skip_errored=True) for g in stepping for i in range(g.size)}
        for g in stepping:
            for i, r in enumerate(g.ranks):
                skipped = r.tf.error is not None or not ok[(g.key, i)]
                r.rider.skipped_collective = (lambda s=skipped: s)
                if not ok[(g.key, i)]:
                    r.tf.report_error(RuntimeError("cross-replica all-reduce failed"))
                    continue
                parts = [(m.gid, m.ranks[i].tf.step) for m in map(self.group, r.tf._pg.ident[2])
                         if m is not None and m.ranks[i].tf.participating]
                r.contribution = (tuple(sorted(parts)), r.tf.participants)

    def _joined_empty(self, g: SimGroup) -> bool:
        """This launch started with nothing, into a running job: restarted by torchrun, or a spare that took an id
        (the engine's ``empty``, :func:`ftbridge.heal.joined_empty`)."""
        return joined_empty(restart_count=g.launch, spare_index=0 if g.spare and not self.revert.spare_holds_state
                            else -1, num_replica_groups=g.num_groups)

    def _empty(self, g: SimGroup) -> bool:
        """Started with nothing (:meth:`_joined_empty`) and has healed or committed nothing since."""
        return self._joined_empty(g) and g.ranks[0].tf.step == 0 and g.heals == 0

    def _borrowed(self, g: SimGroup) -> bool:
        """Started with nothing and has not committed since (the engine's ``borrowed``, ``View.borrowed``)."""
        return self._joined_empty(g) and not g.committed_once and not self.revert.healed_joiner_vouches

    def _restart_rule(self, g: SimGroup, r: SimRank) -> bool:
        """:func:`ftbridge.heal.restart_without_peer` on rank ``r`` after its agreement: reports the error of a
        waiting step; whether the rank says stop."""
        all_empty = bool(r.agreement and r.agreement.all_empty)
        rule = restart_without_peer(restarted_empty=self._empty(g), all_members_empty=all_empty,
                                    waited_s=self.now - g.started_round, limit_s=g.peer_wait)
        if rule == "stop" and self.revert.restart_alone:
            return False
        if rule != "go":
            r.tf.report_error(RuntimeError("restarted with nothing, no member holds the job's state: waiting"))
        return rule == "stop"

    def _agree(self, stepping: List[SimGroup]) -> None:
        """AGREE: every rank's row, one summed collective per process group and group rank, every rank's verdict."""
        rows: Dict[Tuple[Any, int], Dict[int, List[float]]] = {}
        owns: Dict[Tuple[int, int], Optional[List[float]]] = {}
        riders: Dict[Tuple[Any, int], Dict[int, OutageRider]] = {}
        for g in stepping:
            for i, r in enumerate(g.ranks):
                if (g.key, i) in self.faults.late_error and r.tf.error is None:
                    r.tf.report_error(RuntimeError("late error in this step"))
                due = r.guard.due(r.tf.step)
                own = r.rider.own_row(r.params if due else None, self._empty(g), borrowed=self._borrowed(g))
                if own is not None and self.revert.participation_view:
                    own[8] = own[9] = 0.0
                if own is not None and self.revert.continuity:
                    own[17] = own[18] = own[19] = own[22] = 0.0
                    own[ROW_BEHIND:] = [0.0] * (len(own) - ROW_BEHIND)
                if own is not None and self.revert.newest_dead_end_run:
                    own[ROW_BEHIND + 1:] = [0.0] * (len(own) - ROW_BEHIND - 1)
                if own is not None and self.revert.behind_across_restart:
                    own[ROW_BEHIND] = 0.0
                if own is not None and self.revert.riding_row:
                    own[ROW_RIDING] = 0.0
                owns[(g.key, i)] = own
                if own is not None:
                    rows.setdefault((r.tf._pg.ident, i), {})[r.rider.last.replica_rank] = own
                    riders.setdefault((r.tf._pg.ident, i), {})[r.rider.last.replica_rank] = r.rider
        for g in stepping:
            for i, r in enumerate(g.ranks):
                own, summed = owns[(g.key, i)], None
                if own is not None and self._pairs(g, i, skip_errored=False):
                    got = rows[(r.tf._pg.ident, i)]
                    if len(got) == r.rider.last.world_size:
                        summed = [list(got[k]) for k in range(r.rider.last.world_size)]
                held_dead = {m.key for m in map(self.group, r.tf._pg.ident[2] if r.tf._pg.ident else ())
                             if m is not None and (m.key in self.faults.cut_lh or m.key in self.faults.oneway_lh)}
                if self.revert.agreement_watch and held_dead - {g.key}:
                    summed = None  # this member left the wait; the one the lighthouse holds dead completed it
                r.agreement = r.rider.conclude(own, summed, "agreement all-reduce failed")
                if summed is not None and r.agreement.consistent and not r.agreement.continuous:
                    self._check_history_sent(r.rider.last.quorum_id, riders[(r.tf._pg.ident, i)].values(),
                                             r.agreement.reason)
                if self.revert.guard_primary and r.agreement.guard is not None and summed:
                    r.agreement = _primary_guard(r.agreement, summed)

    def _check_history_sent(self, quorum_id: int, members: Any, reason: str) -> None:
        """A quorum discarded for a gap in the job's history must be one its members could not account for
        with everything they hold: every dead end of theirs, not only what fits their rows."""
        if "none of its members took part" not in reason:
            return
        members = [m.history for m in members]
        full = continuous(quorum_id, [(m.certified, id_runs(m.dead, len(m.dead) + 1), m.certified_committers)
                                      for m in members], max(m.missed for m in members))
        assert full is not None, (f"round {self.now}: quorum {quorum_id} was discarded ({reason}), but its members' "
                                  "dead ends together cover every quorum after the certified one: their rows lost it")

    def _decide_and_commit(self, g: SimGroup) -> Record:
        """DECIDE (the in-group exchange), the guard's action, torchft's commit vote, the update."""
        f = self.faults
        step_before = g.ranks[0].tf.step
        empty = (g.launch > 0 or g.spare) and step_before == 0 and g.heals == 0  # the truth, whatever the revert
        flags = []
        for r in g.ranks:
            stop = self._restart_rule(g, r)
            healing, ready = r.heal.state()
            flags.append(encode_flags(rank_flags(step=r.tf.step, errored=r.tf.error is not None,
                                                 agreement=r.agreement, healing=healing, heal_ready=ready,
                                                 replica_group=g.gid, stop=stop,
                                                 gap_stop=(r.rider.gap_expired or g.majority.expired)
                                                 and not self.revert.continuity,
                                                 store_unreachable=r.store_unreachable)))
            r.store_unreachable = False
        decisions = ([decide_group([row]) for row in flags] if self.revert.group_decision
                     else [decide_group(flags)] * len(g.ranks))
        if decisions[0].stop:
            g.alive, g.exit_reason = False, "NoPeerToHealFrom"
        if decisions[0].gap_stop:
            g.alive, g.exit_reason = False, "QuorumGap"
        try:
            for r, d in zip(g.ranks, decisions):
                r.guard.act(step_before, r.agreement.guard if r.agreement else None, d)
        except ReplicaDivergenceError:
            g.alive, g.exit_reason = False, "ReplicaDivergenceError"
        for r, d in zip(g.ranks, decisions):
            r.heal.settle(drop=d.drop_heal)
            if not d.commit:
                r.tf.report_error(RuntimeError(d.reason))
            if r.tf._healing and r.tf._pending_state_dict is not None:  # torchft applies it in should_commit
                r.params = r.tf._pending_state_dict["params"]
        if any(r.tf._healing and r.tf._pending_state_dict is not None for r in g.ranks):
            g.heals += 1
        committed = g.alive and all(r.tf.error is None for r in g.ranks)  # torchft's should_commit: an AND
        g.commit_failures = 0 if committed else g.commit_failures + 1
        g.committed_once |= committed
        if committed:
            g.majority.committed()
        for r, d in zip(g.ranks, decisions):
            if committed:
                corrupt = g.key in f.corrupt
                before = r.params
                r.params = H(r.params, ("corrupt", self.now) if corrupt else r.contribution)
                self.parent[r.params] = before
                if corrupt or before in self.tainted:
                    self.tainted.add(r.params)
                r.tf.step += 1
            r.rider.after_commit(committed, committed and d.ride_next, d.nobody_commits, d.agreed, d.met)
            pause = r.aside.step(quorum_id=r.tf._quorum_id, store_unreachable=d.store_unreachable,
                                 committed=committed)
            if pause and not self.revert.stand_aside:
                g.aside_until = self.now + 1 + int(pause)  # every rank decides alike: the same pause
                g.asides.append((self.now, g.aside_until))
            if self.revert.certify_on_agreement and r.agreement is not None and r.agreement.continuous:
                r.rider.history.held, r.rider.history.missed_here = True, False
        r0 = g.ranks[0]
        return Record(g.gid, g.launch, g.key, empty, step_before, committed, r0.tf.participants, r0.params,
                      r0.rider.riding)

    # -- invariants --------------------------------------------------------------------------------------
    def check(self, records: List[Record]) -> None:
        """After every round: the ranks of a group hold one state; no step is committed twice with different
        parameters (a split while a live group holds the first, committed steps lost once none does); no restarted
        group trains alone from step 0 once the job has committed steps; a clean group never takes a corrupted
        state while most groups hold a clean one."""
        for g in self.groups:
            if g.alive:
                states = {(r.tf.step, r.params) for r in g.ranks}
                assert len(states) == 1, f"round {self.now}: process {g.key}'s ranks hold different states {states}"
        for rec in records:
            if not rec.committed or rec.params in self.tainted:
                continue
            if (rec.launch > 0 or rec.empty) and rec.step_before == 0 and rec.participants <= 1 \
                    and len(self.commits) > 1:
                raise AssertionError(f"round {self.now}: group {rec.group} (process {rec.key}), restarted or a "
                                     "spare, trained alone from step 0 while the job had committed steps: a second, "
                                     "different model")
            first = self.commits.setdefault(rec.step_before, rec.params)
            if first != rec.params and any(self._descends(g.ranks[0].params, first) for g in self.groups if g.alive):
                raise AssertionError(f"round {self.now}: group {rec.group} committed step {rec.step_before} with "
                                     "other parameters than another group did, which a live group holds (split)")
            if first != rec.params:
                raise AssertionError(f"round {self.now}: group {rec.group} (process {rec.key}) committed step "
                                     f"{rec.step_before} again, with other parameters, and no live process holds the "
                                     "first commit of it: committed steps lost")
        live = {g.key for g in self.groups if g.alive}
        clean = {g.key for g in self.groups if g.alive and g.ranks[0].params not in self.tainted}
        before_live, before_clean = self._before
        if self.guard_every and 2 * len(before_clean) > len(before_live):
            took = (before_clean & live) - clean - set(self.faults.corrupt)
            assert not took, f"round {self.now}: clean groups {sorted(took)} took a corrupted state from a minority"
        self._before = (live, clean)

    _before: Tuple[Set[int], Set[int]] = (set(), set())

    def _descends(self, params: str, ancestor: str) -> bool:
        while params is not None:
            if params == ancestor:
                return True
            params = self.parent.get(params)
        return False

    def committing(self) -> Set[int]:
        """Processes (keys: a group's id, or ``groups + k`` for spare k) that committed in the last round."""
        return {r.key for r in self.history[-1] if r.committed} if self.history else set()


class _Result:
    """torchft's quorum result as the rider and torchft read it, for one member."""

    def __init__(self, q: Quorum, me: str) -> None:
        self.quorum_id = q.quorum_id
        self.replica_ids = q.replica_ids
        self.replica_rank = q.replica_ids.index(me)
        self.replica_world_size = len(q.replica_ids)
        self.max_step = q.max_step
        self.store_address = "sim"


def _primary_guard(agreement: Any, summed: List[List[float]]) -> Any:
    """The old rule, for :attr:`Revert.guard_primary`: the primary's fingerprint is the truth."""
    from dataclasses import replace

    from ftbridge.manager.commit import GuardVerdict

    v = agreement.guard
    primary = int(summed[0][1]) - 1
    want = v.digests.get(primary)
    if want is None or v.ok:
        return agreement
    differing = tuple(sorted(gid for gid, d in v.digests.items() if d != want))
    agreeing = tuple(sorted(gid for gid, d in v.digests.items() if d == want))
    return replace(agreement, guard=GuardVerdict(v.digests, want, differing, agreeing))


__all__ = ["Faults", "Revert", "Sim"]
