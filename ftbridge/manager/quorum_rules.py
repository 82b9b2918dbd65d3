"""Pure rules of a quorum change (lighthouse restarts, the reconfigure vote, group sizes, key namespaces),
applied by :class:`ftbridge.manager.quorum_guard._QuorumGuard` on torchft's quorum thread.

Why: docs/lighthouse.md, "Restart survival"; docs/design.md, "Lighthouse restarts" and "The quorum guard".
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

from ftbridge.manager.lighthouse_status import replica_group_of


@dataclass(frozen=True)
class QuorumSeen:
    """What one rank remembers of the last quorum it took part in."""

    quorum_id: int
    members: Tuple[str, ...]


def detect_lighthouse_restart(prev: Optional[QuorumSeen], quorum_id: int, members: Sequence[str]) -> bool:
    """Whether ``quorum_id``/``members`` (any order) must come from a restarted lighthouse: the id went down since
    ``prev``, or repeated with other members (pure; ``prev`` ``None``: no)."""
    if prev is None:
        return False
    return quorum_id < prev.quorum_id or (quorum_id == prev.quorum_id and tuple(sorted(members)) != prev.members)


def decide_reconfigure(own: bool, votes: Optional[Sequence[bool]]) -> bool:
    """Rebuild if any member's vote (``votes``, ``True``: rebuild) says so; ``own`` when the vote could not complete
    (``votes`` ``None``) (pure)."""
    if votes is None:
        return own
    return own or any(votes)


VOTE_SKIP_WINDOW_S = 1.0
"""Seconds: the longest quorum call, and gap since the previous call returned, with which a steady member skips the vote
(:func:`vote_needed`)."""


def vote_needed(own: bool, same_as_voted: bool, rode: bool, call_s: float, since_last_s: float,
                commit_failures: int) -> bool:
    """Whether this member must take part in the reconfigure vote of a quorum (pure).

    It skips it only when not ``own``, ``same_as_voted`` (the quorum it last voted in), no ``commit_failures``,
    not ``rode`` since its previous call, and ``call_s`` and ``since_last_s`` (from the previous call's return)
    both under :data:`VOTE_SKIP_WINDOW_S`. Why that is safe: docs/lighthouse.md, "Restart survival".
    """
    steady = not rode and call_s < VOTE_SKIP_WINDOW_S and since_last_s < VOTE_SKIP_WINDOW_S
    return own or not same_as_voted or commit_failures > 0 or not steady


class GroupSizeMismatch(ValueError):
    """This replica group has another number of ranks than the quorum's primary: it must not heal or all-reduce."""


def group_size_conflict(sizes: Sequence[int], replica_rank: int, quorum_id: int) -> Optional[str]:
    """Why this member (``replica_rank``) must leave quorum ``quorum_id``, or ``None``: its entry in ``sizes`` (ranks
    per group, by replica rank; 0: unknown, never judged) differs from replica rank 0's."""
    if not sizes or replica_rank >= len(sizes):
        return None
    mine, primary = int(sizes[replica_rank]), int(sizes[0])
    if not mine or not primary or mine == primary:
        return None
    return (f"quorum {quorum_id}: this replica group has {mine} ranks but the quorum's primary group has "
            f"{primary}; every replica group must have the same number of ranks (ZeRO partitions and heal state "
            f"are shaped by it). Restart this group with {primary} ranks in all (ftbridge-run --nproc-per-node "
            f"x --nnodes), or restart every group with {mine}")


def heals_backwards(step: int, max_step: int) -> bool:
    """Whether a heal a quorum orders takes a group holding ``step`` to the earlier ``max_step``.

    The lighthouse computes a member's step from the last request it read of that group; a late request of a
    call the group left to ride carries an older step, so the quorum can rank the group behind a peer it is
    ahead of. Healing would overwrite the group's committed steps with the peer's older state; the step is
    discarded instead and the next request carries the true step (docs/design.md, "No heal backwards").
    """
    return step > max_step


def rendezvous_namespace(members: Sequence[str], max_step: int) -> str:
    """The key namespace shared by all members of one quorum: 12 hex digits of its members and step."""
    text = "|".join(sorted(members)) + f"|{max_step}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def lacks_majority(previous_members: Sequence[str], members: Sequence[str]) -> bool:
    """Whether the quorum of ``members`` holds at most half of the groups of ``previous_members``, the last quorum
    before a lighthouse restart (pure)."""
    before, now = {_group(m) for m in previous_members}, {_group(m) for m in members}
    return 2 * len(before & now) <= len(before)


def _group(replica_id: str) -> Union[int, str]:
    """The replica group of a torchft replica id; an id of another form counts as a group of its own."""
    group = replica_group_of(replica_id)
    return replica_id if group is None else group


class RestartMajority:
    """After a lighthouse restart, which quorums may commit (one group's state; pure, the clock is passed in).

    Until this group commits again, a quorum that :func:`lacks_majority` of the groups that last held the
    job's history is discarded; past ``wait_s`` seconds (counted from the latest of the restart, the last
    quorum that held the majority, and :meth:`unanswered`) :attr:`expired` is set and the group stops.

    Raises:
        ValueError: ``wait_s`` < 0.
    """

    def __init__(self, wait_s: float) -> None:
        if wait_s < 0:
            raise ValueError(f"wait_s={wait_s} must be >= 0")
        self.wait_s = wait_s
        self.pending: Optional[Tuple[Tuple[str, ...], float]] = None
        """``(replica ids before the restart, monotonic s of the restart)`` while a majority is needed."""
        self.expired = False
        """The last quorum lacked the majority and the wait has passed."""

    def restarted(self, before: Sequence[str], now: float) -> None:
        """A restart was detected at ``now``; ``before``: the replica ids that last held the job's history (empty:
        nothing required)."""
        if self.pending is None and before:
            self.pending = (tuple(before), now)

    def unanswered(self, now: float) -> None:
        """The lighthouse did not answer up to ``now``: the wait starts again (only delays a stop)."""
        if self.pending is not None:
            self.pending = (self.pending[0], now)

    def lacks(self, members: Sequence[str], now: float) -> bool:
        """Whether the quorum of ``members`` must be discarded; updates :attr:`expired`."""
        if self.pending is None:
            return False
        before, since = self.pending
        if not lacks_majority(before, members):  # they are back: a later quorum without them gets the whole wait
            self.pending, self.expired = (before, now), False
            return False
        self.expired = now - since >= self.wait_s
        return True

    def committed(self) -> None:
        """The group committed a step: the requirement is met; the agreement's continuity takes over."""
        self.pending, self.expired = None, False

