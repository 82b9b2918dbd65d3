"""Warm spare replica groups: fully initialised, outside the quorum until a group dies.

A spare (``ftbridge-run --spare-index K``) runs the training script like any
replica group: imports, data, model, ``deepspeed.initialize`` (optimizer and
ZeRO partitions allocated). Then, in :func:`ftbridge.initialize`, before the
torchft manager exists, it stands by (:func:`stand_by`): group rank 0 polls
the lighthouse's read-only ``GET /status`` (:mod:`ftbridge.manager.lighthouse_status`) every
:data:`POLL_S` until a replica group of ``0..num_replica_groups-1`` is
*vacant*, takes over that group's id, and tells its other ranks through the
group's own TCPStore. ``initialize`` then builds the engine with that id:
the torchft manager starts, joins the next quorum and heals from a live
group like a cold restart of that group would, only without the process
start and DeepSpeed initialisation (about 4 s here).

Why the manager is not started before the vacancy
--------------------------------------------------
torchft 0.2's manager server heartbeats to the lighthouse from the moment it
exists, and heartbeats alone change quorums: the lighthouse's split-brain
guard needs more than half of the *heartbeating* replicas to ask for a
quorum, and a quorum that changes membership waits ``join_timeout_ms`` for
heartbeating replicas that do not ask. With 2 active groups and a
heartbeating spare, the survivor of a kill is 1 of 2 heartbeating replicas:
no quorum until the spare joins, and a spare that hangs would stall the job.
So a spare is invisible to the lighthouse until it joins; everything else
(process, imports, DeepSpeed engine, optimizer state) is ready. The manager,
its heartbeat and the heal transport start at the join (tens of ms).

Vacancy (:func:`vacancies`, pure)
---------------------------------
Group ``G`` is vacant when the lighthouse has heard of ``replica_group_G``
(it has a heartbeat entry) but every such entry is older than the
lighthouse's heartbeat timeout (``stale``): the moment the lighthouse drops
the group from its quorums. A group never heard of is not vacant (at job
start the active groups may simply not be up yet), and nothing is vacant
while no group is live (a spare has nothing to heal from; it would restart
training from step 0). Live (:func:`live_groups`) is stricter than fresh:
a heartbeat at most half as old as the youngest stale one. When every
group loses the lighthouse at once (it hangs, or a partition cuts them all
off), their heartbeats age together, and the read in which the first turns
stale shows the others fresh by a few milliseconds; none of them is live
then, so the spare takes nothing from an outage. A group that lives
heartbeats every ``heartbeat_interval`` (100 ms), far below half the timeout.

Which group, and which replica id
---------------------------------
The spare takes the smallest vacant id and uses it everywhere a cold
replacement of that group would: ``cfg.replica_group_id``, hence the data
shard (``dp_rank = G * group_size + group_rank``, :mod:`ftbridge.harness.data`), the
event log path, and torchft's ``replica_id = replica_group_G`` (torchft
appends a fresh UUID, as for any restart). torchft derives the group's
global rank from that id's trailing digits, and the lighthouse orders
quorum members by replica id, so the spare's replica rank is the one a cold
restart of ``G`` would get. Data seen per step is therefore unchanged.

Several spares: spare ``K`` takes a vacancy only after it has been vacant
for ``K * STAGGER_S`` seconds (:func:`choose_group`); by then a spare before
it has joined and heartbeats as that group, so the id is no longer vacant.
Spare 0 reacts at once. While it stands by, each rank's ``spare_ready``
event (time, pid) is in the event log of id ``num_replica_groups + K``
(``ftbridge-run`` gives a spare that id until it joins); after the join it
writes to the log of the group it replaced, starting with ``start`` and a
``spare_join`` event (:meth:`Takeover.event`). A spare whose job is over (no live group for
``cfg.restart_peer_wait``, after one was seen) exits with status 0.

A cold restart of the dead group (torchrun ``--max-restarts``) may come back
after a spare took its id. It must not join as a second ``G`` (two groups
would read one data shard), so a *restarted* group checks first
(:func:`demote_if_taken`): if another process holds its id (a fresh
heartbeat for ``replica_group_G`` younger than this process's ftbridge
import, so not its own dead predecessor's), it becomes a spare itself
(index ``N + G``, so it acts after the launched spares) and stands by. A group
that was only paused past the heartbeat timeout and resumes after a spare took
its id heals into a quorum where another member holds that id; it leaves
(:func:`must_leave`, raised from :meth:`ftbridge.manager.ReplicaManager._on_quorum`
before torchft heals), and its restart stands by.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ftbridge.config import FTBridgeConfig

logger = logging.getLogger(__name__)

POLL_S = 0.05
"""Seconds between two lighthouse status reads of a standing-by spare (one HTTP GET each)."""
STAGGER_S = 1.0
"""Seconds spare ``K`` lets a vacancy stand per index before taking it (spare 0: at once)."""
STATUS_TIMEOUT_S = 2.0
"""Bound on one status read (s); a read that fails counts as "nothing seen" and is retried."""
SLOW_READ_S = 1.0
"""A status read slower than this counts as failed: the lighthouse was hung or its link down meanwhile."""
SETTLE_S = 0.5
"""After a failed status read, how long a vacancy must be seen in reads that answer before a spare takes it: a
lighthouse that was hung or cut off shows every group's heartbeat stale until the groups' next ones arrive."""
DEMOTED_KEY = "ftbridge/spare/demoted"
"""Key of the group's TCPStore holding rank 0's verdict on a restarted group: "1" stand by, "0" go on."""
STORE_KEY = "ftbridge/spare/replaces"
"""Key of the group's TCPStore holding rank 0's decision: the replaced group id, or -1 (exit)."""


def heartbeat_groups(heartbeats: Sequence[Any]) -> Tuple[set, set]:
    """The replica groups with a fresh heartbeat, and every group the lighthouse has heard of (pure).

    Args:
        heartbeats: :class:`ftbridge.manager.lighthouse_status.Heartbeat` records (``replica_id``, ``stale``).

    Returns:
        ``(fresh, known)``: sets of ftbridge replica group ids; replica ids not
        named ``replica_group_G...`` are ignored.
    """
    from ftbridge.manager.lighthouse_status import replica_group_of

    fresh, known = set(), set()
    for hb in heartbeats:
        g = replica_group_of(hb.replica_id)
        if g is None:
            continue
        known.add(g)
        if not hb.stale:
            fresh.add(g)
    return fresh, known


def held_by_another(heartbeats: Sequence[Any], group: int, since_s: float) -> bool:
    """Whether a live process other than this one's dead predecessor holds ``replica_group_<group>`` (pure).

    Args:
        heartbeats: :class:`ftbridge.manager.lighthouse_status.Heartbeat` records (``replica_id``, ``age_s``,
            ``stale``).
        group: this restarted group's id.
        since_s: seconds since this process imported ftbridge. The predecessor died before this
            process started, so its last heartbeat is older than that; a live holder's is at most
            one heartbeat interval old.
    """
    from ftbridge.manager.lighthouse_status import replica_group_of

    return any(replica_group_of(h.replica_id) == group and not h.stale and h.age_s < since_s for h in heartbeats)


class DuplicateReplicaGroup(RuntimeError):
    """Another member of the quorum holds this replica group's id (a spare took it while this group was paused)."""


def must_leave(replica_ids: Sequence[str], group: int, healing: bool, me: Optional[str] = None,
               nobody_heals: bool = False) -> bool:
    """Whether this member must leave a quorum in which another member holds its group id (pure).

    A group paused past the lighthouse's heartbeat timeout (SIGSTOP, a stalled host) is dropped like a
    dead one and a spare takes its id; when it resumes it asks for quorums again and would train as a
    second copy of the group, on the same data shard. It is the one behind, so it heals in that quorum:
    the healing holder of a duplicated id leaves (its torchrun restart then finds the id held and stands
    by, :func:`demote_if_taken`). When nobody in the quorum heals (two spares that took one id at step 0),
    every holder but the first by replica id leaves, so exactly one stays. A holder knows only whether it
    heals itself, and both may (a restart that came back while the lighthouse could not show the id was
    taken, beside a spare that fell behind): the first holder by replica id therefore stays even when it
    heals. At most one holder stays then, or both for one step, after which nobody heals and the rule
    above keeps the first; never none.

    Args:
        replica_ids: the quorum's torchft replica ids (``replica_group_G:UUID``).
        group: this member's replica group id.
        healing: whether this member heals in this quorum (it is behind the quorum's step).
        me: this member's replica id in the quorum (``None``: unknown, only the healing rule applies).
        nobody_heals: every member is at the quorum's highest step (torchft's ``max_world_size`` equals
            ``replica_world_size``).
    """
    from ftbridge.manager.lighthouse_status import replica_group_of

    holders = sorted(r for r in replica_ids if replica_group_of(r) == group)
    if len(holders) <= 1:
        return False
    first = me is not None and me == holders[0]
    return (healing and not first) or (nobody_heals and me is not None and not first)


def live_groups(heartbeats: Sequence[Any]) -> set:
    """The replica groups with a fresh heartbeat at most half as old as the youngest stale one (pure).

    Args:
        heartbeats: :class:`ftbridge.manager.lighthouse_status.Heartbeat` records (``replica_id``, ``age_s``,
            ``stale``).

    Returns:
        A set of replica group ids; every fresh group when nothing is stale.
    """
    from ftbridge.manager.lighthouse_status import replica_group_of

    stale_ages = [hb.age_s for hb in heartbeats if hb.stale]
    bound = min(stale_ages) / 2 if stale_ages else float("inf")
    groups = {replica_group_of(hb.replica_id) for hb in heartbeats if not hb.stale and hb.age_s <= bound}
    return {g for g in groups if g is not None}


def vacancies(fresh: set, known: set, num_groups: int, live: Optional[set] = None) -> List[int]:
    """Group ids a spare may take, smallest first (pure; see the module docstring).

    Args:
        fresh: groups with a fresh heartbeat; known: groups with any heartbeat entry.
        num_groups: the job's planned number of replica groups.
        live: groups that are clearly alive (:func:`live_groups`); default ``fresh``.

    Returns:
        Ids in ``0..num_groups-1`` heard of but not fresh; empty while no group is live.
    """
    if not any(0 <= g < num_groups for g in (fresh if live is None else live)):
        return []
    return sorted(g for g in known if 0 <= g < num_groups and g not in fresh)


def choose_group(vacant: Sequence[int], first_seen: Dict[int, float], now: float, spare_index: int,
                 stagger_s: float = STAGGER_S) -> Optional[int]:
    """The group this spare takes now, or ``None`` (pure).

    Args:
        vacant: current vacancies (:func:`vacancies`).
        first_seen: group id -> time (s, any clock) this spare first saw it vacant.
        now: the same clock's current time.
        spare_index: this spare's index ``K``: it waits ``K * stagger_s`` after a vacancy appears.
        stagger_s: seconds per index.

    Returns:
        The smallest vacant id that has been vacant long enough.
    """
    wait = spare_index * stagger_s
    for g in sorted(vacant):
        if now - first_seen.get(g, now) >= wait:
            return g
    return None


@dataclass
class VacancyWatch:
    """A spare's memory between status reads: when each vacancy and the last live group were seen.

    Args:
        num_groups: the job's planned number of replica groups.
        spare_index: this spare's index.
        job_gone_s: seconds without a live group (after one was seen) after which the job counts as over.
    """

    num_groups: int
    spare_index: int
    job_gone_s: float
    first_seen: Dict[int, float] = field(default_factory=dict)
    last_live: Optional[float] = None
    settled_after: Optional[float] = 0.0
    """Vacancies count from this time on (``None``: the last read failed; set by the next one that answers)."""
    last_seen: str = ""
    """The last status read's heartbeats, ``replica id: age s (stale)``, for the decision's log line."""

    def observe(self, now: float, heartbeats: Optional[Sequence[Any]]) -> Tuple[str, Optional[int]]:
        """Update with one status read (``None``: the read failed) at ``now`` (s).

        Returns:
            ``("join", G)``, ``("wait", None)`` or ``("exit", None)`` (the job is over).
        """
        if heartbeats is None:  # the lighthouse did not answer: whatever it shows next needs time to settle
            self.first_seen, self.settled_after = {}, None
            return "wait", None
        if self.settled_after is None:
            self.settled_after = now + SETTLE_S
        fresh, known = heartbeat_groups(heartbeats)
        self.last_seen = ", ".join(f"{h.replica_id}: {h.age_s:.2f} s{' (stale)' if h.stale else ''}"
                                   for h in heartbeats)
        if any(0 <= g < self.num_groups for g in fresh):
            self.last_live = now
        elif self.last_live is not None and now - self.last_live >= self.job_gone_s:
            return "exit", None
        vacant = vacancies(fresh, known, self.num_groups, live_groups(heartbeats))
        self.first_seen = {g: self.first_seen.get(g, now) for g in vacant}
        g = choose_group(vacant, self.first_seen, now, self.spare_index)
        if g is not None and now < self.settled_after:
            return "wait", None
        return ("join", g) if g is not None else ("wait", None)


@dataclass(frozen=True)
class Takeover:
    """What a spare did: the config it trains with and when it decided (wall time, s since the epoch)."""

    cfg: FTBridgeConfig
    standby_start: float
    """When the spare was ready and began to stand by."""
    vacancy_seen: float
    """When group rank 0 first saw the group it took as vacant (the lighthouse had dropped it); on the
    other ranks, when they learnt rank 0's decision."""
    decided: float
    """When it decided to take it."""

    def event(self) -> Dict[str, Any]:
        """The ``spare_join`` event record (for the event log)."""
        return {"event": "spare_join", "time": self.decided, "replaces": self.cfg.replica_group_id,
                "spare_index": self.cfg.spare_index, "standby_start": self.standby_start,
                "vacancy_seen": self.vacancy_seen}


def _read_heartbeats(address: str, fetch: Callable[..., Any],
                     clock: Callable[[], float] = time.monotonic) -> Optional[List[Any]]:
    """The lighthouse's heartbeat table, or ``None`` when the read failed or took longer than :data:`SLOW_READ_S`."""
    t0 = clock()
    try:
        beats = list(fetch(address, timeout_s=STATUS_TIMEOUT_S).heartbeats)
    except (OSError, ValueError) as exc:  # unreachable, HTTP error, or not torchft's page: retry
        logger.debug("spare: lighthouse status read failed: %s", exc)
        return None
    return beats if clock() - t0 <= SLOW_READ_S else None


def watch_lighthouse(cfg: FTBridgeConfig, *, fetch: Optional[Callable[..., Any]] = None,
                     clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep,
                     restarted: Optional[bool] = None) -> Tuple[Optional[int], float]:
    """Group rank 0's stand-by loop: poll the lighthouse until a vacancy is taken or the job is over.

    Args:
        cfg: this spare's settings (``lighthouse``, ``num_replica_groups``, ``spare_index``,
            ``restart_peer_wait`` as the job-over bound).
        fetch: ``fetch(address, timeout_s=) -> LighthouseStatus``; default
            :func:`ftbridge.manager.lighthouse_status.fetch_status`.
        clock, sleep: wall clock (s) and sleep, for tests.
        restarted: torchrun restarted this launch (default: ``TORCHELASTIC_RESTART_COUNT`` > 0). Its
            predecessor ran while the job was live, so the job-over bound counts from now even if no live
            group is ever seen (a launch restarted after the job ended would otherwise stand by forever).

    Returns:
        ``(group id or None when the job is over, wall time the group was first seen vacant)``.
    """
    if fetch is None:
        from ftbridge.manager.lighthouse_status import fetch_status

        fetch = fetch_status
    watch = VacancyWatch(cfg.num_replica_groups, cfg.spare_index, cfg.restart_peer_wait.total_seconds())
    if restarted is None:
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if restarted:
        watch.last_live = clock()
    while True:
        now = clock()
        action, group = watch.observe(now, _read_heartbeats(cfg.lighthouse, fetch))
        if action == "join" and group is not None:
            logger.warning("[spare %d] lighthouse heartbeats when deciding: %s", cfg.spare_index,
                        watch.last_seen)
            return group, watch.first_seen[group]
        if action == "exit":
            return None, now
        sleep(POLL_S)


def share_decision(store: Any, group_rank: int, decision: Optional[int] = None,
                   sleep: Callable[[float], None] = time.sleep) -> Optional[int]:
    """Rank 0 publishes its decision on the group's TCPStore; the other ranks wait for it.

    Args:
        store: a ``torch.distributed.Store`` shared by the group's ranks.
        group_rank: this rank.
        decision: rank 0's decision (group id, or ``None`` for "the job is over").

    Returns:
        The decision, on every rank.
    """
    if group_rank == 0:
        store.set(STORE_KEY, str(-1 if decision is None else int(decision)))
        return decision
    while not store.check([STORE_KEY]):  # stand-by may last hours: no single bounded wait fits
        sleep(POLL_S)
    value = int(store.get(STORE_KEY).decode())
    return None if value < 0 else value


def _mark_ready(cfg: FTBridgeConfig, when: float) -> None:
    """Write a ``spare_ready`` event (time, pid) to the event log of this spare's pre-join id ``N + K``."""
    import os

    from ftbridge.events import EventLog

    log = EventLog(cfg.event_log_path(), {"replica_group": cfg.replica_group_id, "group_rank": cfg.group_rank})
    log.write(event="spare_ready", time=when, pid=os.getpid(), spare_index=cfg.spare_index)
    log.close()


def demote_if_taken(cfg: FTBridgeConfig, *, restart_count: int, imported_at: float, store: Any = None,
                    fetch: Optional[Callable[..., Any]] = None) -> FTBridgeConfig:
    """``cfg`` as a spare if this restarted group's id is held by another process (a spare took it), else ``cfg``.

    Only for a group torchrun restarted (``restart_count > 0``) in a job of
    several groups; group rank 0 reads the lighthouse once and shares the
    verdict on the group's TCPStore. An unreadable lighthouse counts as "not
    taken" (the group goes on as before spares existed).

    Args:
        cfg: the active group's config.
        restart_count: ``TORCHELASTIC_RESTART_COUNT``.
        imported_at: when this process imported ftbridge (:data:`ftbridge.IMPORTED_AT`).
        store, fetch: see :func:`stand_by`.

    Returns:
        ``cfg``, or a spare's config: ``spare_index = N + G`` and, while it stands by,
        ``replica_group_id = N + spare_index`` (its ``spare_ready`` events stay out of group ``G``'s log).
    """
    if cfg.spare_index >= 0 or restart_count <= 0 or cfg.num_replica_groups < 2:
        return cfg
    taken = False
    if cfg.group_rank == 0:
        if fetch is None:
            from ftbridge.manager.lighthouse_status import fetch_status

            fetch = fetch_status
        beats = _read_heartbeats(cfg.lighthouse, fetch)
        taken = beats is not None and held_by_another(beats, cfg.replica_group_id, time.time() - imported_at)
    if cfg.group_size > 1:
        if store is None:
            import torch.distributed.distributed_c10d as c10d

            store = c10d._get_default_store()
        if cfg.group_rank == 0:
            store.set(DEMOTED_KEY, "1" if taken else "0")
        else:
            taken = store.get(DEMOTED_KEY).decode() == "1"  # rank 0 answers within one status read
    if not taken:
        return cfg
    index = cfg.num_replica_groups + cfg.replica_group_id
    logger.warning("[replica %d rank %d] restarted, but another process holds replica group %d (a spare took its "
                   "place): standing by as spare %d instead of joining as a second copy", cfg.replica_group_id,
                   cfg.group_rank, cfg.replica_group_id, index)
    return dataclasses.replace(cfg, spare_index=index, replica_group_id=cfg.num_replica_groups + index)


def stand_by(cfg: FTBridgeConfig, *, store: Any = None, fetch: Optional[Callable[..., Any]] = None) -> Takeover:
    """Stand by until a replica group is vacant, then return the config of its replacement.

    Call after the group's DeepSpeed engine exists and before its torchft
    manager does (:func:`ftbridge.initialize` does). Every rank of the spare
    group calls it.

    Args:
        cfg: the spare's config (``spare_index >= 0``).
        store: the group's TCPStore (default: torch.distributed's default store).
        fetch: see :func:`watch_lighthouse`.

    Returns:
        A :class:`Takeover` whose ``cfg`` has ``replica_group_id`` set to the vacant group.

    Raises:
        ValueError: ``cfg`` is not a spare's.
        SystemExit: (status 0) the job is over before any group needed replacing.
    """
    if cfg.spare_index < 0:
        raise ValueError(f"spare_index={cfg.spare_index}: stand_by is for spares (ftbridge-run --spare-index K)")
    if store is None and cfg.group_size > 1:
        import torch.distributed.distributed_c10d as c10d

        store = c10d._get_default_store()
    start = time.time()
    _mark_ready(cfg, start)
    logger.info("[spare %d rank %d] ready; standing by outside the quorum for a vacant replica group of %d",
                cfg.spare_index, cfg.group_rank, cfg.num_replica_groups)
    group, seen = watch_lighthouse(cfg, fetch=fetch) if cfg.group_rank == 0 else (None, 0.0)
    if cfg.group_size > 1:
        group = share_decision(store, cfg.group_rank, group)
    seen = seen if cfg.group_rank == 0 else time.time()
    if group is None:
        logger.info("[spare %d rank %d] no live replica group left: the job is over, exiting",
                    cfg.spare_index, cfg.group_rank)
        sys.exit(0)
    decided = time.time()
    logger.warning("[spare %d rank %d] replica group %d is vacant: taking its place", cfg.spare_index,
                   cfg.group_rank, group)
    return Takeover(dataclasses.replace(cfg, replica_group_id=group), start, seen, decided)
