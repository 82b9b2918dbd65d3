"""Warm spare replica groups: fully initialised, outside the quorum until a group dies.

Entry points: :func:`stand_by` (from :func:`ftbridge.initialize`, ``ftbridge-run --spare-index K``),
:func:`demote_if_taken` (a restarted group whose id a spare took), :func:`must_leave` (a duplicated id
in a quorum). Vacancy rules: :func:`vacancies`, :func:`live_groups`, :func:`choose_group`, :class:`VacancyWatch`.

Why: docs/spares.md.
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
"""Seconds between two status reads of a standing-by spare."""
VACANT_FOR_S = 2.0
"""Seconds a vacancy must stand, in reads this close together, before spare 0 takes it: a live group whose
heartbeat was late past the lighthouse's timeout (a starved heartbeat thread) is fresh again by then."""
STAGGER_S = 1.0
"""Seconds spare ``K`` lets a vacancy stand per index, beyond :data:`VACANT_FOR_S`, before taking it."""
STATUS_TIMEOUT_S = 2.0
"""Bound on one status read (s); a failed read counts as "nothing seen" and is retried."""
SLOW_READ_S = 1.0
"""A status read slower than this (s) counts as failed (the lighthouse was hung or cut off meanwhile)."""
PROBE_S = 1.0
"""Bound on the probe of a vacant group's own TCPStore before taking its id (s): an answer means it lives."""
DEMOTED_KEY = "ftbridge/spare/demoted"
"""Group TCPStore key of rank 0's verdict on a restarted group: "1" stand by, "0" go on."""
STORE_KEY = "ftbridge/spare/replaces"
"""Group TCPStore key of rank 0's decision: the replaced group id, or -1 (exit)."""


def heartbeat_groups(heartbeats: Sequence[Any]) -> Tuple[set, set]:
    """``(fresh, known)`` group ids of :class:`ftbridge.manager.lighthouse_status.Heartbeat` records (pure).

    ``fresh``: with a fresh heartbeat; ``known``: every group heard of. Other replica ids are ignored.
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

    ``since_s``: seconds since this process imported ftbridge; a fresh heartbeat younger than that is another's.
    """
    from ftbridge.manager.lighthouse_status import replica_group_of

    return any(replica_group_of(h.replica_id) == group and not h.stale and h.age_s < since_s for h in heartbeats)


class DuplicateReplicaGroup(RuntimeError):
    """Another member of the quorum holds this replica group's id (a spare took it while this group was paused)."""


def must_leave(replica_ids: Sequence[str], group: int, healing: bool, me: Optional[str] = None,
               healers: Optional[int] = None) -> bool:
    """Whether this member must leave a quorum in which another member holds its group id (pure).

    A healing holder leaves when it is the only member that heals (every other holder is up to date) or when it
    is not the first holder by replica id; when nobody heals, every holder but the first leaves. Why:
    docs/spares.md, "Limits".

    Args:
        replica_ids: the quorum's torchft replica ids (``replica_group_G:UUID``).
        group: this member's replica group id.
        healing: whether this member heals in this quorum.
        me: this member's replica id (``None``: unknown, only the healing rule applies).
        healers: how many members of the quorum heal (torchft's ``replica_world_size - max_world_size``);
            ``None``: unknown.
    """
    from ftbridge.manager.lighthouse_status import replica_group_of

    holders = sorted(r for r in replica_ids if replica_group_of(r) == group)
    if len(holders) <= 1:
        return False
    first = me is not None and me == holders[0]
    if healing:
        return healers == 1 or not first
    return healers == 0 and me is not None and not first


def live_groups(heartbeats: Sequence[Any]) -> set:
    """Group ids with a fresh heartbeat at most half as old as the youngest stale one, or any fresh one (pure)."""
    from ftbridge.manager.lighthouse_status import replica_group_of

    stale_ages = [hb.age_s for hb in heartbeats if hb.stale]
    bound = min(stale_ages) / 2 if stale_ages else float("inf")
    groups = {replica_group_of(hb.replica_id) for hb in heartbeats if not hb.stale and hb.age_s <= bound}
    return {g for g in groups if g is not None}


def vacancies(fresh: set, known: set, num_groups: int, live: Optional[set] = None) -> List[int]:
    """Ids of ``0..num_groups-1`` in ``known`` but not ``fresh``, smallest first (pure).

    Empty while no group is ``live`` (default: ``fresh``).
    """
    if not any(0 <= g < num_groups for g in (fresh if live is None else live)):
        return []
    return sorted(g for g in known if 0 <= g < num_groups and g not in fresh)


def choose_group(vacant: Sequence[int], first_seen: Dict[int, float], now: float, spare_index: int,
                 stagger_s: float = STAGGER_S, vacant_for_s: float = VACANT_FOR_S) -> Optional[int]:
    """The smallest ``vacant`` id vacant for at least ``vacant_for_s + spare_index * stagger_s`` seconds, or
    ``None`` (pure).

    ``first_seen`` maps a group id to when (s, the clock of ``now``) this spare first saw it vacant, in the
    reads since; a read that shows it held again forgets it (:class:`VacancyWatch`).
    """
    wait = vacant_for_s + spare_index * stagger_s
    for g in sorted(vacant):
        if now - first_seen.get(g, now) >= wait:
            return g
    return None


@dataclass
class VacancyWatch:
    """A spare's memory between status reads: when each vacancy and the last live group were seen.

    ``job_gone_s``: seconds without a live group, after one was seen, until the job counts as over.
    """

    num_groups: int
    spare_index: int
    job_gone_s: float
    first_seen: Dict[int, float] = field(default_factory=dict)
    last_live: Optional[float] = None
    last_seen: str = ""
    """The last read's heartbeats, ``replica id: age s (stale)``, for the log line."""
    stores: Dict[int, str] = field(default_factory=dict)
    """The newest TCPStore address (``host:port``) seen for each group among the lighthouse's quorum members."""

    def remember_stores(self, members: Sequence[Any]) -> None:
        """Keep each group's store address from a read's quorum ``members``
        (:class:`ftbridge.manager.lighthouse_status.Member`)."""
        for m in members:
            if m.replica_group is not None and m.store_address:
                self.stores[m.replica_group] = m.store_address

    def still_held(self, group: int, now: float) -> None:
        """``group`` answered on its own store although the lighthouse shows it stale (cut off from the
        lighthouse, alive): its vacancy counts anew from ``now``."""
        self.first_seen[group] = now

    def observe(self, now: float, heartbeats: Optional[Sequence[Any]]) -> Tuple[str, Optional[int]]:
        """Take one status read (``None``: failed) at ``now`` (s); ``("join", G)``, ``("wait"|"exit", None)``.

        A lighthouse that does not answer shows no live group: the job counts as over ``job_gone_s`` after the last
        live group was seen, as when every group is stale (a job ended and its lighthouse stopped)."""
        if heartbeats is None:  # the lighthouse did not answer: a vacancy counts again from the next answer
            self.first_seen = {}
            gone = self.last_live is not None and now - self.last_live >= self.job_gone_s
            return ("exit" if gone else "wait"), None
        fresh, known = heartbeat_groups(heartbeats)
        self.last_seen = ", ".join(f"{h.replica_id}: {h.age_s:.2f} s{' (stale)' if h.stale else ''}"
                                   for h in heartbeats)
        if any(0 <= g < self.num_groups for g in fresh):
            self.last_live = now
        elif self.last_live is not None and now - self.last_live >= self.job_gone_s:
            return "exit", None
        vacant = vacancies(fresh, known, self.num_groups, live_groups(heartbeats))
        self.first_seen = {g: self.first_seen.get(g, now) for g in vacant}
        g = choose_group(vacant, self.first_seen, now, self.spare_index, vacant_for_s=VACANT_FOR_S)
        return ("join", g) if g is not None else ("wait", None)


@dataclass(frozen=True)
class Takeover:
    """What a spare did: the config it trains with and when it decided (wall time, s since the epoch)."""

    cfg: FTBridgeConfig
    standby_start: float
    """When the spare was ready and began to stand by."""
    vacancy_seen: float
    """When rank 0 first saw the taken group vacant; on other ranks, when they learnt the decision."""
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
    status = _read_status(address, fetch, clock)
    return None if status is None else list(status.heartbeats)


def _read_status(address: str, fetch: Callable[..., Any], clock: Callable[[], float] = time.monotonic) -> Any:
    """The lighthouse's status, or ``None`` when the read failed or took longer than :data:`SLOW_READ_S`."""
    t0 = clock()
    try:
        status = fetch(address, timeout_s=STATUS_TIMEOUT_S)
    except (OSError, ValueError) as exc:  # unreachable, HTTP error, or not torchft's page: retry
        logger.debug("spare: lighthouse status read failed: %s", exc)
        return None
    return status if clock() - t0 <= SLOW_READ_S else None


def store_answers(store_address: str, timeout_s: float = PROBE_S) -> bool:
    """Whether the TCPStore at ``store_address`` (``host:port``) answers one request within ``timeout_s``: its
    process lives. Refused, reset or unanswered (a dead or stopped process): ``False``."""
    from datetime import timedelta

    from ftbridge.manager.store_probe import probe_store

    try:
        probe_store(store_address, timedelta(seconds=timeout_s))
    except (TimeoutError, RuntimeError, OSError, ValueError) as exc:  # the stated outcome: no answer
        logger.debug("spare: store %s does not answer: %s", store_address, exc)
        return False
    return True


def watch_lighthouse(cfg: FTBridgeConfig, *, fetch: Optional[Callable[..., Any]] = None,
                     clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep,
                     restarted: Optional[bool] = None,
                     probe: Callable[[str], bool] = store_answers) -> Tuple[Optional[int], float]:
    """Group rank 0's stand-by loop: poll the lighthouse until a vacancy is taken or the job is over.

    A group due to be taken whose own TCPStore (its address from the last quorum that listed it) still answers
    lives, cut off from the lighthouse only: it keeps its id and its vacancy counts anew (docs/spares.md).

    Args:
        cfg: the spare's settings; ``restart_peer_wait`` bounds the wait without a live group.
        fetch: ``fetch(address, timeout_s=) -> LighthouseStatus``; default
            :func:`ftbridge.manager.lighthouse_status.fetch_status`.
        clock, sleep: wall clock (s) and sleep, for tests.
        restarted: this launch was restarted by torchrun (default: ``TORCHELASTIC_RESTART_COUNT`` > 0);
            the job-over bound then counts from now.
        probe: ``probe(store_address) -> bool``, whether that store answers (default :func:`store_answers`).

    Returns:
        ``(group id, or None when the job is over; wall time it was first seen vacant)``.
    """
    if fetch is None:
        from ftbridge.manager.lighthouse_status import fetch_status

        fetch = fetch_status
    watch = VacancyWatch(cfg.num_replica_groups, cfg.spare_index, cfg.restart_peer_wait.total_seconds())
    if restarted is None:
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if restarted:
        watch.last_live = clock()
    spared: set = set()  # groups found alive on their store in this vacancy, logged once
    while True:
        now = clock()
        status = _read_status(cfg.lighthouse, fetch)
        if status is not None:
            watch.remember_stores(getattr(status, "members", ()))
        action, group = watch.observe(now, None if status is None else list(status.heartbeats))
        if action == "join" and group is not None:
            address = watch.stores.get(group)
            if address is not None and probe(address):
                if group not in spared:
                    logger.warning("[spare %d] replica group %d has no fresh heartbeat at the lighthouse, but its "
                                "store %s answers: it lives, cut off from the lighthouse; not taking its id",
                                cfg.spare_index, group, address)
                spared.add(group)
                watch.still_held(group, clock())
                sleep(POLL_S)
                continue
            logger.warning("[spare %d] lighthouse heartbeats when deciding: %s", cfg.spare_index,
                        watch.last_seen)
            return group, watch.first_seen[group]
        spared &= set(watch.first_seen)  # a group fresh again starts a new vacancy
        if action == "exit":
            return None, now
        sleep(POLL_S)


def share_decision(store: Any, group_rank: int, decision: Optional[int] = None,
                   sleep: Callable[[float], None] = time.sleep) -> Optional[int]:
    """Rank 0 publishes ``decision`` (group id; ``None``: job over) on ``store``; every rank returns it."""
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


def _settled_reads(address: str, fetch: Callable[..., Any], bound_s: float, label: str,
                   clock: Callable[[], float] = time.monotonic,
                   sleep: Callable[[float], None] = time.sleep) -> List[List[Any]]:
    """Heartbeat tables to judge the lighthouse's view by: its first answer within ``bound_s`` seconds and, when
    reads failed before it, every answer in the :data:`VACANT_FOR_S` after it (a lighthouse that was hung shows
    live groups stale until their next heartbeats arrive). Empty when it never answered; ``label`` names the
    caller in the log."""
    deadline = clock() + bound_s
    beats = _read_heartbeats(address, fetch, clock)
    if beats is not None:
        return [beats]
    logger.warning("%s lighthouse %s does not answer: waiting up to %g s for it before joining, to learn whether "
                   "a spare holds this group's id", label, address, bound_s)
    while beats is None and clock() < deadline:
        sleep(POLL_S)
        beats = _read_heartbeats(address, fetch, clock)
    if beats is None:
        return []
    reads, settled = [beats], clock() + VACANT_FOR_S
    while clock() < settled:
        sleep(POLL_S)
        more = _read_heartbeats(address, fetch, clock)
        if more is not None:
            reads.append(more)
    return reads


def demote_if_taken(cfg: FTBridgeConfig, *, restart_count: int, imported_at: float, store: Any = None,
                    fetch: Optional[Callable[..., Any]] = None, clock: Callable[[], float] = time.monotonic,
                    sleep: Callable[[float], None] = time.sleep) -> FTBridgeConfig:
    """``cfg`` as spare ``N + G`` if another process holds this restarted group's id, else ``cfg``.

    Only for a torchrun restart (``restart_count > 0``) in a job of several groups. Rank 0 reads the lighthouse
    until it answers, at most ``quorum_timeout`` (a group cannot join a quorum sooner anyway; still no answer:
    not taken), then for :data:`VACANT_FOR_S` more if it had not answered at once, and shares the verdict on the
    group's TCPStore. ``imported_at`` is :data:`ftbridge.IMPORTED_AT`; ``store``, ``fetch`` as in
    :func:`stand_by`; ``clock``, ``sleep`` for tests.

    Raises:
        torch.distributed.DistStoreError: (ranks other than 0) rank 0's verdict did not come within
            ``quorum_timeout`` plus :data:`VACANT_FOR_S` plus two status reads.
    """
    if cfg.spare_index >= 0 or restart_count <= 0 or cfg.num_replica_groups < 2:
        return cfg
    label = f"[replica {cfg.replica_group_id} rank {cfg.group_rank}] restarted, but the"
    bound_s = cfg.quorum_timeout.total_seconds()
    taken = False
    if cfg.group_rank == 0:
        if fetch is None:
            from ftbridge.manager.lighthouse_status import fetch_status

            fetch = fetch_status
        reads = _settled_reads(cfg.lighthouse, fetch, bound_s, label, clock, sleep)
        if not reads:
            logger.warning("%s lighthouse gave no answer in %g s: joining as replica group %d (if a spare holds "
                           "the id, one of the two leaves at their first quorum together)", label, bound_s,
                           cfg.replica_group_id)
        taken = any(held_by_another(beats, cfg.replica_group_id, time.time() - imported_at) for beats in reads)
    if cfg.group_size > 1:
        if store is None:
            import torch.distributed.distributed_c10d as c10d

            store = c10d._get_default_store()
        if cfg.group_rank == 0:
            store.set(DEMOTED_KEY, "1" if taken else "0")
        else:
            from datetime import timedelta

            store.wait([DEMOTED_KEY], timedelta(seconds=bound_s + VACANT_FOR_S + 2 * STATUS_TIMEOUT_S))
            taken = store.get(DEMOTED_KEY).decode() == "1"
    if not taken:
        return cfg
    index = cfg.num_replica_groups + cfg.replica_group_id
    logger.warning("[replica %d rank %d] restarted, but another process holds replica group %d (a spare took its "
                   "place): standing by as spare %d instead of joining as a second copy", cfg.replica_group_id,
                   cfg.group_rank, cfg.replica_group_id, index)
    return dataclasses.replace(cfg, spare_index=index, replica_group_id=cfg.num_replica_groups + index)


def stand_by(cfg: FTBridgeConfig, *, store: Any = None, fetch: Optional[Callable[..., Any]] = None) -> Takeover:
    """Stand by until a replica group is vacant; return the config of its replacement.

    Every rank of the spare calls it, after its DeepSpeed engine exists and before its torchft manager does.

    Args:
        cfg: the spare's config (``spare_index >= 0``).
        store: the group's TCPStore (default: torch.distributed's default store).
        fetch: see :func:`watch_lighthouse`.

    Returns:
        A :class:`Takeover` whose ``cfg.replica_group_id`` is the vacant group.

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
        logger.warning("[spare %d rank %d] no live replica group for %g s (restart_peer_wait), or the lighthouse "
                       "stopped answering: the job is over, exiting", cfg.spare_index, cfg.group_rank,
                       cfg.restart_peer_wait.total_seconds())
        sys.exit(0)
    decided = time.time()
    logger.warning("[spare %d rank %d] replica group %d is vacant: taking its place", cfg.spare_index,
                   cfg.group_rank, group)
    return Takeover(dataclasses.replace(cfg, replica_group_id=group), start, seen, decided)
