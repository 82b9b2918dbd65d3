"""Survive lighthouse restarts: :class:`_QuorumGuard` wraps torchft's manager client (torchft 0.2 internals).

Per quorum it applies :mod:`ftbridge.manager.quorum_rules`: detects a restart, runs the reconfigure vote
on the quorum's TCPStore (skipped on a steady quorum), refuses another group size, requires a majority
after a restart and namespaces the rendezvous keys; the outage rider and the peer watch hook in here.
Why: docs/lighthouse.md, "Restart survival"; docs/design.md, "The quorum guard".
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple

from ftbridge.manager.futures import call_bounded
from ftbridge.manager.outage import OutageRider, QuorumTimeout, TryNotMade
from ftbridge.manager.quorum_rules import (
    GroupSizeMismatch,
    QuorumSeen,
    RestartMajority,
    decide_reconfigure,
    detect_lighthouse_restart,
    group_size_conflict,
    heals_backwards,
    rendezvous_namespace,
    vote_needed,
)
from ftbridge.manager.quorum_watch import wait_for_keys
from ftbridge.manager.torchft_api import (
    TORCHFT_GUARDED_VERSIONS,
    Manager,
    create_store_client,
    installed_version,
    internals_supported,
)

logger = logging.getLogger(__name__)


class HealBackwards(RuntimeError):
    """The quorum told this group to heal to an earlier step than it holds: the step is discarded, nothing is
    fetched (:func:`ftbridge.manager.quorum_rules.heals_backwards`)."""


class _QuorumView:
    """A torchft ``QuorumResult`` with the attributes in ``overrides`` replaced; every other one is the original's."""

    def __init__(self, result: Any, **overrides: Any) -> None:
        self._result = result
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._result, name)


class _QuorumGuard:
    """Wraps torchft's ``ManagerClient`` of one rank (as ``Manager._client``); anything not overridden is delegated.

    torchft calls ``_quorum`` from its quorum thread, then compares ``quorum_id`` with ``Manager._quorum_id``
    and reconfigures with ``store_address``.
    """

    def __init__(self, manager: Manager, timeout: timedelta, on_restart: Callable[[int, int], None],
                 on_quorum: Optional[Callable[[Any], None]] = None, group_size: int = 0,
                 store_timeout: Optional[timedelta] = None, majority_wait: timedelta = timedelta(seconds=30)) -> None:
        # timeout bounds the vote (FTBridgeConfig.vote_timeout), store_timeout each store call
        # (FTBridgeConfig.store_call_timeout; default 2 x timeout).
        self._manager = manager
        self._store_timeout = store_timeout
        self._on_quorum = on_quorum
        self._client = manager._client
        self._timeout = timeout
        self._on_restart = on_restart
        self._stores: Dict[str, Any] = {}
        self._last_vote: Optional[Tuple[Any, str, int]] = None
        self._group_size = group_size
        self.sizes: List[int] = []
        """Every member's group size at the last vote, by replica rank (empty when the vote failed)."""
        self._voted: Optional[Tuple[int, Tuple[str, ...]]] = None  # quorum id and members of the last complete vote
        self._returned = float("-inf")  # time.monotonic() when the last quorum call returned
        self.last_result: Any = None
        """The quorum torchft got for its latest step: the lighthouse's, or the last one again while riding."""
        self._rode = False  # rode on the last quorum since the last quorum from the lighthouse
        self.votes_skipped = 0
        """Quorums whose reconfigure vote this member skipped (:func:`ftbridge.manager.quorum_rules.vote_needed`)."""
        self.seen: Optional[QuorumSeen] = None
        self.restarts = 0
        self.forced = 0
        self.majority = RestartMajority(majority_wait.total_seconds())
        """Which quorums may commit after a lighthouse restart (told of commits by the replica manager)."""
        self.no_majority = 0
        """Steps discarded because a quorum after a lighthouse restart lacked a majority of the groups before it."""
        self.refused_heals = 0
        """Quorums that told this group to heal to an earlier step than it held (:class:`HealBackwards`)."""
        self.quorum_timeout = timedelta(seconds=30)
        """torchft's quorum timeout (``FTBridgeConfig.quorum_timeout``), named in the error when it expires."""
        self.rider: Optional[OutageRider] = None
        """Rides out lighthouse outages on the last quorum (:mod:`ftbridge.manager.outage`); set by ReplicaManager."""
        self.watch: Any = None
        """The peer watch, or ``None``: a wait it cut short makes this member vote to rebuild; it ends the vote's wait
        when a member is dead."""

    def _quorum(self, **kwargs: Any) -> Any:
        def call(timeout: timedelta) -> Any:
            return self._client._quorum(**{**kwargs, "timeout": timeout})

        started = time.monotonic()
        try:  # the rider makes the call's tries and rides out lighthouse outages (outage.py)
            result = self.rider.quorum(call) if self.rider is not None else self._client._quorum(**kwargs)
        except TryNotMade as exc:  # a rank other than 0 whose tries ended without the answer its rank 0 got
            raise QuorumTimeout(
                f"this rank's copy of the quorum its replica group's rank 0 got this step was lost ({exc}): its "
                "own tries timed out or were not made, and its rank 0 went on with an answer it cannot share. This "
                "rank exits; torchrun restarts its group, which heals from a live peer") from exc
        except TimeoutError as exc:  # torchft's quorum timeout (the builtin TimeoutError)
            raise QuorumTimeout(
                f"no quorum within the quorum timeout ({self.quorum_timeout.total_seconds():g} s, "
                "FTBRIDGE_QUORUM_TIMEOUT_S) and this step could not ride on the last quorum: the lighthouse "
                "does not answer, or fewer replica groups than its --min-replicas are alive. This rank exits; "
                "torchrun restarts its group, which heals from a live peer once there is one") from exc
        returned, since_last = time.monotonic(), started - self._returned
        self._returned = returned
        if self.rider is not None and (self.rider.riding or self.rider.lost):  # the last quorum again
            self._rode |= self.rider.riding
            self.last_result = result
            return result
        if bool(getattr(result, "heal", False)):
            step = int(self._manager.current_step())
            if heals_backwards(step, int(result.max_step)):
                result = self._refuse_heal(result, step)
        if self._on_quorum is not None:  # before torchft, on this same thread, fetches any heal of this quorum
            self._on_quorum(result)
        quorum_id, members = int(result.quorum_id), list(result.replica_ids)
        restarted = detect_lighthouse_restart(self.seen, quorum_id, members)
        if restarted:
            self.restarts += 1
            self._on_restart(self.seen.quorum_id if self.seen else -1, quorum_id)
            before = (self.rider.certified_members() if self.rider is not None else ()) or (
                self.seen.members if self.seen is not None else ())
            self.majority.restarted(before, time.monotonic())
        if self.rider is not None and self.rider.unanswered_tries:  # the lighthouse went unanswered a try or more
            self.majority.unanswered(time.monotonic())
        self._check_majority(quorum_id, members)
        self.seen = QuorumSeen(quorum_id, tuple(sorted(members)))
        namespace = rendezvous_namespace(members, int(result.max_step))
        own = restarted or quorum_id != self._manager._quorum_id
        if self.watch is not None and self.watch.take_rebuild():  # peer watch (ftbridge.manager.quorum_watch)
            own = True
        key = (quorum_id, tuple(sorted(members)))
        if vote_needed(own, key == self._voted, self._rode, returned - started, since_last,
                       int(kwargs.get("commit_failures", 1))):
            rebuild = self._vote(result, namespace, own)
            self._voted = key if self.sizes else None
        else:  # a steady quorum: every member keeps its process group, as torchft would (vote_needed)
            rebuild = False
            self.votes_skipped += 1
        self._rode = False
        conflict = group_size_conflict(self.sizes, int(result.replica_rank), quorum_id)
        if conflict:  # before torchft reconfigures or fetches a heal with this quorum
            logger.error("%s", conflict)
            raise GroupSizeMismatch(conflict)
        if rebuild:
            if not own:
                self.forced += 1
                logger.warning("quorum %d: another member rebuilds the cross-replica process group "
                               "(its lighthouse history differs); rebuilding too", quorum_id)
            self._manager._quorum_id = -1  # torchft compares right after this returns: reconfigure
        view = _QuorumView(result, store_address=f"{result.store_address}/ftbridge/{namespace}")
        if self.rider is not None:  # lighthouse outage (ftbridge.manager.outage): the quorum a riding step reuses
            self.rider.remember(view, members)
        self.last_result = view
        return view

    def _refuse_heal(self, result: Any, step: int) -> Any:
        """``result`` without its heal, and a :class:`HealBackwards` error recorded (this step is discarded on every
        rank of the group, holding ``step``: each computes the same from the same quorum and step)."""
        max_step = int(result.max_step)
        msg = (f"quorum {int(result.quorum_id)} tells this group to heal to step {max_step}, but it holds step {step}: "
               "the lighthouse counted a late request, with an older step, of a call this group left to ride; the "
               "step is discarded and nothing is fetched (healing would overwrite committed steps)")
        logger.warning("%s", msg)
        self.refused_heals += 1
        self._manager.report_error(HealBackwards(msg))
        return _QuorumView(result, heal=False, recover_src_manager_address="", recover_src_replica_rank=None)

    @property
    def majority_expired(self) -> bool:
        """A quorum after a lighthouse restart has lacked the majority for longer than the wait."""
        return self.majority.expired

    def _check_majority(self, quorum_id: int, members: List[str]) -> None:
        """After a lighthouse restart, record an error (the step is discarded) on a quorum that lacks the majority
        (:class:`~ftbridge.manager.quorum_rules.RestartMajority`) until the group commits; past ``majority_wait``
        :attr:`majority_expired` is set."""
        was_expired, now = self.majority.expired, time.monotonic()
        if not self.majority.lacks(members, now):
            return
        assert self.majority.pending is not None
        before, since = self.majority.pending
        if self.majority.expired and not was_expired:
            logger.error("quorum %d after a lighthouse restart holds %d of the %d groups of the last quorum before "
                         "it, %.0f s after the restart: stopping rather than fork the job",
                         quorum_id, len(members), len(before), now - since)
        self.no_majority += 1
        self._manager.report_error(RuntimeError(
            f"quorum {quorum_id} after a lighthouse restart holds {sorted(members)}, not more than half of the "
            f"groups of the last quorum before it ({sorted(before)}): the others may still be reconnecting, and "
            "two such quorums could commit the same step apart; step discarded, asking again"))

    def _vote(self, result: Any, namespace: str, mine: bool) -> bool:
        """Publish ``mine`` and return the quorum-wide decision
        (:func:`~ftbridge.manager.quorum_rules.decide_reconfigure`).

        The store calls run bounded by ``store_call_timeout`` (a hung primary's store never answers); past it, or
        on any error, the vote counts as failed.
        """
        base = f"{int(result.quorum_id)}/{namespace}"
        store, last = self._stores.get(result.store_address), self._last_vote
        votes: Optional[List[bool]] = None
        self.sizes = []
        try:
            store, votes, self.sizes, voted = call_bounded(
                lambda: _vote_on_store(result, base, mine, store, last, self._timeout, self._group_size, self.watch),
                self._store_timeout or 2 * self._timeout, f"the primary's store {result.store_address}")
            self._stores = {result.store_address: store}  # one cached client: the current primary's
            self._last_vote = (store, voted, int(result.replica_rank))
        except Exception as exc:  # noqa: BLE001 - a member or the store died or hung: the step fails anyway
            logger.warning("quorum %d: reconfigure vote failed (%s: %s); %s as torchft would",
                           int(result.quorum_id), type(exc).__name__, (str(exc).splitlines() or [""])[0],
                           "rebuilding" if mine else "keeping the process group")
            self._stores = {}
        return decide_reconfigure(mine, votes)

    def should_commit(self, group_rank: int, step: int, should_commit: bool, timeout: timedelta) -> Any:
        """torchft's commit vote of the group: the AND of every group rank's ``should_commit``; a one-rank group answers
        it here.

        Raises:
            TimeoutError: (larger groups) not every rank voted within ``timeout``.
        """
        if self._group_size == 1:
            return bool(should_commit)
        return self._client.should_commit(group_rank, step, should_commit, timeout=timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def _vote_on_store(result: Any, base: str, mine: bool, store: Any, last: Optional[Tuple[Any, str, int]],
                   timeout: timedelta, group_size: int = 0,
                   watch: Any = None) -> Tuple[Any, List[bool], List[int], str]:
    """One rank's vote on the primary's store under the key prefix ``base``: write ``mine`` and ``group_size`` (0:
    unknown), wait for every member's (under ``watch``), read them; delete the previous vote ``last`` only on this
    store.

    Each member counts its votes under ``base`` (``store.add``) and votes under ``base/<count>``: a quorum that
    repeats an earlier one's id, members and step (after a lighthouse restart) never reads a vote left from
    the earlier one. Members whose counts differ wait for each other's keys until ``timeout``: a failed vote.

    Returns:
        ``(store client, votes, sizes, this vote's key prefix)``, by replica rank.

    Raises:
        Whatever the store raises: ``DistStoreError`` when a vote does not come within ``timeout``.
    """
    if store is None:
        store = create_store_client(f"{result.store_address}/ftbridge/vote", timeout=timeout)
    base = f"{base}/{int(store.add(f'{base}/count/{int(result.replica_rank)}', 1))}"
    store.set(f"{base}/{int(result.replica_rank)}", f"{int(mine)}:{int(group_size)}".encode())
    keys = [f"{base}/{r}" for r in range(int(result.replica_world_size))]
    wait_for_keys(store, keys, timeout, watch)
    values = [(bytes(v).decode(errors="replace").split(":") + [""])[:2] for v in store.multi_get(keys)]
    votes = [v == "1" for v, _ in values]
    sizes = [int(n) if n.isdigit() else 0 for _, n in values]
    # Drop this rank's previous vote, only on the store that just answered: a previous primary's
    # store may be hung (its group's rank 0 SIGSTOPped), and deleting there blocked (chaos soak).
    if last is not None and last[0] is store and last[1] != base:
        store.delete_key(f"{last[1]}/{last[2]}")
    return store, votes, sizes, base


def _install_quorum_guard(manager: Manager, timeout: timedelta, on_restart: Callable[[int, int], None],
                          on_quorum: Optional[Callable[[Any], None]] = None,
                          group_size: int = 0, store_timeout: Optional[timedelta] = None,
                          majority_wait: timedelta = timedelta(seconds=30)) -> Optional[_QuorumGuard]:
    """Install :class:`_QuorumGuard` on ``manager`` if this torchft is one it was written for."""
    if not internals_supported(manager):
        logger.warning("torchft %s is not one of %s: lighthouse-restart guard NOT installed; after a "
                       "lighthouse restart a repeated quorum id may cost a failed step, and heal URLs are not "
                       "checked against the donor's host", installed_version(),
                       TORCHFT_GUARDED_VERSIONS)
        return None
    guard = _QuorumGuard(manager, timeout, on_restart, on_quorum, group_size, store_timeout, majority_wait)
    manager._client = guard
    return guard
