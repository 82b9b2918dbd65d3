"""A replica group cut off from its peers, but not from the lighthouse, leaves the quorums for a while.

:class:`StandAside` is the rule (pure: every rank of a group feeds it the same inputs and gets the same
answer); :func:`leave_quorums` carries it out on one rank. The reasoning and the measurements are in
``docs/concepts.md`` (the commit protocol, ASIDE) and ``docs/design.md``.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any, Callable, List, Optional

from ftbridge.manager.torchft_api import pause_manager_server

logger = logging.getLogger(__name__)


class StandAside:
    """Whether a replica group cut off from its peers, but not from the lighthouse, leaves the quorums for a while.

    The lighthouse judges a group by its heartbeats and quorum calls; a group that still reaches the
    lighthouse but not its peers therefore stays in every quorum, and every step with it fails after the
    cross-replica timeout. With two groups, the lighthouse's majority rule (more than half of the
    heartbeating groups must ask) keeps the other group from getting a quorum of its own: the job stops
    training until the link is back. The group that cannot reach the quorum's store takes itself out: it
    stops heartbeating (torchft's manager server shut down) for a pause, then comes back and heals.

    The evidence is group rank 0's probe of the quorum's store (group rank 0 of every member rendezvouses on
    the store of the same primary group): it failed (no answer within the cross-replica timeout, or a
    refused connection) in ``after`` consecutive quorums (distinct ids) in which this group committed nothing.
    A group appears in a quorum only if it asked for it, so the store's group was alive after the first
    failure: a killed or vanished group does not ask for the next quorum. The pause doubles
    with each stand-aside until the group commits again, up to ``max_s``; with the primary itself cut
    off, every other group stands aside and the primary trains alone until they are back.

    After a lighthouse restart the groups that remain wait at most ``restart_peer_wait`` for a majority of
    the groups before it (:class:`ftbridge.manager.quorum_rules.RestartMajority`), so a group standing aside must be
    back within that wait: the driver passes ``max_s`` below it, and reports no failed store while such a
    wait is pending (the group stays in the quorums: it counts towards the majority).

    Every rank of the group feeds the same inputs (its group decision and torchft's commit vote, an AND over
    the group), so every rank reaches the same answer.

    Args:
        after: consecutive silent quorums before standing aside (>= 1).
        base_s: the first pause (seconds, > 0).
        max_s: the longest pause (seconds; default ``8 * base_s``).
    """

    AFTER = 2
    """The default ``after``."""
    MAX_DOUBLINGS = 3

    def __init__(self, *, after: int = AFTER, base_s: float, max_s: Optional[float] = None) -> None:
        if after < 1:
            raise ValueError(f"after={after} must be at least 1")
        if base_s <= 0:
            raise ValueError(f"base_s={base_s} must be positive")
        self.after, self.base_s = after, base_s
        self.max_s = base_s * 2 ** self.MAX_DOUBLINGS if max_s is None else max_s
        if self.max_s <= 0:
            raise ValueError(f"max_s={self.max_s} must be positive")
        self._silent: List[int] = []  # quorum ids of this run of silent stores
        self._pauses = 0  # stand-asides since the group last committed

    def step(self, *, quorum_id: int, store_unreachable: bool, committed: bool) -> float:
        """Feed one step's outcome; the seconds to stand aside now (0.0: stay).

        Args:
            quorum_id: the step's quorum id.
            store_unreachable: the group's decision's :attr:`GroupDecision.store_unreachable`.
            committed: torchft's commit vote for the step.
        """
        if committed:
            self._silent, self._pauses = [], 0
            return 0.0
        if not store_unreachable:
            self._silent = []
            return 0.0
        if quorum_id not in self._silent:
            self._silent.append(quorum_id)
        if len(self._silent) < self.after:
            return 0.0
        self._silent = []
        self._pauses += 1
        return min(self.base_s * 2 ** min(self._pauses - 1, self.MAX_DOUBLINGS), self.max_s)


def leave_quorums(manager: Any, *, pause_s: float, group_rank: int, barrier: Callable[[], Any],
                  lighthouse_addr: str, hostname: str, heartbeat_interval: timedelta, connect_timeout: timedelta,
                  quorum_retries: int) -> None:
    """Stand aside for ``pause_s`` seconds on this rank; every rank of the group calls it at the same step.

    Group rank 0 shuts its torchft manager server down (the lighthouse stops hearing the group and forgets
    it after its heartbeat timeout), every rank waits out the pause, rank 0 builds the server again on the
    same port (:func:`ftbridge.manager.torchft_api.pause_manager_server`), and ``barrier`` (one in-group
    exchange) holds the other ranks until it is back. The next quorum holds the group again, behind the
    others: it heals.

    Args:
        manager: this rank's torchft ``Manager``.
        pause_s: seconds out of the quorums (> 0).
        group_rank: this rank's rank in its replica group.
        barrier: one collective over the replica group.
        lighthouse_addr, hostname, heartbeat_interval, connect_timeout, quorum_retries: what group rank 0's
            manager server was built with.

    Raises:
        RuntimeError: ``barrier`` failed (a rank of the group died meanwhile); the rank must exit.
    """
    resume = None
    if group_rank == 0:
        resume = pause_manager_server(manager, lighthouse_addr=lighthouse_addr, hostname=hostname,
                                      heartbeat_interval=heartbeat_interval, connect_timeout=connect_timeout,
                                      quorum_retries=quorum_retries)
    time.sleep(pause_s)  # the pause itself: nothing to wait for, the group is out of the quorums
    if resume is not None:
        resume()
    barrier()


def longest_pause(base_s: float, restart_peer_wait_s: float) -> float:
    """The longest pause a group may stand aside: ``8 * base_s``, and half of ``restart_peer_wait`` when that
    wait is on (> 0), so that the group is back before the others stop waiting for it after a lighthouse
    restart (the other half covers its way back: a heartbeat timeout, a quorum, a heal)."""
    cap = base_s * 2 ** StandAside.MAX_DOUBLINGS
    return min(cap, restart_peer_wait_s / 2) if restart_peer_wait_s > 0 else cap
