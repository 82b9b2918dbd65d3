"""A replica group cut off from its peers, but not from the lighthouse, leaves the quorums for a while.

:class:`StandAside` is the rule (pure: every rank of a group feeds it the same inputs and gets the same
answer); :func:`leave_quorums` carries it out on one rank; :func:`longest_pause` caps the pause.
Why: docs/concepts.md, "The commit protocol" (ASIDE); docs/design.md, "Standing aside keeps every
argument above".
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any, Callable, List, Optional

from ftbridge.manager.torchft_api import pause_manager_server

logger = logging.getLogger(__name__)


class StandAside:
    """Whether a replica group cut off from its peers, but not from the lighthouse, stands aside now, and for how long.

    It stands aside after group rank 0's store probe failed in ``after`` (>= 1) consecutive quorums in which
    the group committed nothing; the pause starts at ``base_s`` (> 0) and doubles with each stand-aside until
    the group commits, up to ``max_s`` (default ``8 * base_s``; keep it within :func:`longest_pause`). Every
    rank must feed it the same inputs; ``ValueError`` for an argument out of range.
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
        """Feed one step's outcome (``store_unreachable``: :attr:`GroupDecision.store_unreachable`; ``committed``:
        torchft's vote); the seconds to stand aside now (0.0: stay)."""
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
    """Stand aside for ``pause_s`` seconds; every rank of the group calls it at the same step.

    Group rank 0 shuts its manager server down and builds it again on the same port with the arguments it was
    built with (:func:`ftbridge.manager.torchft_api.pause_manager_server`); ``barrier`` (one collective over
    the group) holds the other ranks until then.

    Raises:
        RuntimeError: ``barrier`` failed; the rank must exit.
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
    """The longest pause: ``8 * base_s``, and at most half of ``restart_peer_wait_s`` when that is > 0.

    Why: docs/design.md, "Standing aside keeps every argument above"."""
    cap = base_s * 2 ** StandAside.MAX_DOUBLINGS
    return min(cap, restart_peer_wait_s / 2) if restart_peer_wait_s > 0 else cap
