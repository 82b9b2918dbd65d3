"""Pure rules of a quorum change: lighthouse restarts, the reconfigure vote, group sizes, key namespaces.

No torchft, no clock, no network: :class:`ftbridge.manager.quorum_guard._QuorumGuard`
applies them on torchft's quorum thread.

The lighthouse keeps its state in memory; restarted, it numbers quorums from
1 again. torchft 0.2.0's ``Manager`` rebuilds the cross-replica process group
only when ``quorum_id != self._quorum_id`` and names the rendezvous keys
``{store}/torchft/{quorum_id}/{group_rank}``. After a restart both go wrong:

* a member whose last quorum had the id the new one repeats keeps its process
  group, while a member that saw an intermediate quorum of the new
  lighthouse rebuilds: the step fails and waits out ``cross_replica_timeout``
  (likewise a repeated id with other members than last time);
* a rebuilt group may rendezvous on the keys a quorum of the old lighthouse
  left in the same TCPStore (same prefix) and dial dead addresses.

The first case is the common one: the group whose retry reaches the new
lighthouse first gets quorum 1 alone, the other joins at quorum 2, an id
both had before. That step then fails after the cross-replica timeout, and
the job pauses for twice the timeout instead of once.

:class:`ftbridge.manager.quorum_guard._QuorumGuard` fixes both without touching torchft's code: it wraps the
manager's client (``Manager._client``, checked against the installed torchft
version) and, per quorum,

1. detects a restart with :func:`detect_lighthouse_restart`: the id went
   backwards, or repeated with other members (in one lighthouse's lifetime
   ids never go down and a membership change always bumps the id);
2. votes: every member of the quorum writes whether it rebuilds (torchft's
   rule, or a detected restart) to the quorum's TCPStore (``store_address``,
   the same for all members of one cross-replica group) and reads the
   others'; if any member rebuilds, all do (:func:`decide_reconfigure`), by
   setting ``Manager._quorum_id = -1`` before torchft compares. One
   ``set`` and one ``multi_get`` on that store per quorum, in torchft's
   quorum thread, overlapped with the forward pass (0.3 ms on loopback here).
   The vote also carries the member's group size: a member whose replica
   group has another number of ranks than replica rank 0's raises
   :class:`GroupSizeMismatch` there (:func:`group_size_conflict`), before
   torchft reconfigures or fetches a heal, and the training thread gets it at
   its next cross-replica call; the other members go on;
3. namespaces the rendezvous keys by the quorum's members and step
   (``{store}/ftbridge/{digest}/torchft/...``), the same for all members, so
   a repeated id does not meet the keys of a quorum of the old lighthouse.

If the vote cannot complete within ``FTBridgeConfig.vote_timeout`` (a quarter of ``cross_replica_timeout``)
(a member or the store's host died after the quorum), the rank falls back to
torchft's own rule: that step fails on the dead member anyway, and the next
quorum, without it, has a new id, which every member rebuilds for. Rebuilding
on a failed vote instead would dial the dead store for the whole store timeout,
longer than the other ranks' ``should_commit`` waits.
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
    """Whether ``quorum_id``/``members`` must come from a restarted lighthouse (pure).

    Within one lighthouse's lifetime quorum ids never go down, and a quorum
    with other members always gets a new id; a quorum that breaks either
    rule comes from a restarted lighthouse (its ids start again at 1).

    Args:
        prev: the previous quorum this rank took part in (``None``: none yet).
        quorum_id: id of the new quorum.
        members: replica ids of its participants (any order).
    """
    if prev is None:
        return False
    return quorum_id < prev.quorum_id or (quorum_id == prev.quorum_id and tuple(sorted(members)) != prev.members)


def decide_reconfigure(own: bool, votes: Optional[Sequence[bool]]) -> bool:
    """The quorum-wide decision from every member's vote (pure).

    Args:
        own: this rank's own vote (torchft's rule or a detected restart).
        votes: every member's vote (``True``: rebuild), or ``None`` when the
            vote could not complete (a member or the store died).

    Returns:
        ``True`` if any member rebuilds: a process group must be rebuilt by
        all its members or by none. ``own`` when the vote failed.
    """
    if votes is None:
        return own
    return own or any(votes)


VOTE_SKIP_WINDOW_S = 1.0
"""Longest quorum call, and longest time since the previous one returned, after which a steady member still
skips the reconfigure vote (:func:`vote_needed`)."""


def vote_needed(own: bool, same_as_voted: bool, rode: bool, call_s: float, since_last_s: float,
                commit_failures: int) -> bool:
    """Whether this member must take part in the reconfigure vote of a quorum (pure).

    The vote exists for quorums whose id some member sees as changed and
    another as unchanged. Within one lighthouse's lifetime that cannot
    happen: the id changes with the members, and torchft's lighthouse also
    changes it whenever a member reports a failed commit (torchft 0.2,
    ``commit_failures``; ``docs/concepts.md``, "The commit protocol"). So a
    member skips the vote, and keeps its process group as torchft would, only
    when all of these hold, and votes otherwise:

    * ``own`` is false: it would not rebuild by itself (same id as its process
      group, no restart detected, no cut wait);
    * ``same_as_voted``: the quorum's id and members are those of the last
      vote it completed (so every member's group size is known);
    * its last step committed (``commit_failures == 0``), so every member of the
      quorum agreed on that step with the same quorum id;
    * it saw the lighthouse answer steadily since: no ride-through since the
      last quorum (``rode``), the call took under :data:`VOTE_SKIP_WINDOW_S`
      and began within that window of the previous call's return. A restarted
      lighthouse, which numbers quorums from 1 again, is seen by a member
      that calls it every step as a failed or slow call; one that was frozen
      or busy for longer than the window votes.

    Args:
        own: this member's own rebuild wish.
        same_as_voted: the quorum equals the last one this member voted in.
        rode: this member rode on its last quorum since its previous call.
        call_s: seconds the quorum call took.
        since_last_s: seconds from the previous call's return to this call's start.
        commit_failures: torchft's count of failed commits since the last success.
    """
    steady = not rode and call_s < VOTE_SKIP_WINDOW_S and since_last_s < VOTE_SKIP_WINDOW_S
    return own or not same_as_voted or commit_failures > 0 or not steady


class GroupSizeMismatch(ValueError):
    """This replica group has another number of ranks than the quorum's primary: it must not heal or all-reduce."""


def group_size_conflict(sizes: Sequence[int], replica_rank: int, quorum_id: int) -> Optional[str]:
    """Why this member must leave the quorum, or ``None``: its group size differs from replica rank 0's.

    Args:
        sizes: every member's group size (ranks per replica group), by replica rank; 0 where unknown.
        replica_rank: this member's rank in the quorum.
        quorum_id: for the message.

    Replica rank 0 (the quorum's primary) is the reference, so exactly the members that differ from it
    leave and the others go on; a member of unknown size (0) is never judged.
    """
    if not sizes or replica_rank >= len(sizes):
        return None
    mine, primary = int(sizes[replica_rank]), int(sizes[0])
    if not mine or not primary or mine == primary:
        return None
    return (f"quorum {quorum_id}: this replica group has {mine} ranks but the quorum's primary group has "
            f"{primary}; every replica group must have the same number of ranks (ZeRO partitions and heal state "
            f"are shaped by it). Restart this group with {primary} ranks in all (ftbridge-run --nproc-per-node "
            f"x --nnodes), or restart every group with {mine}")


def rendezvous_namespace(members: Sequence[str], max_step: int) -> str:
    """The key namespace shared by all members of one quorum: 12 hex digits of its members and step."""
    text = "|".join(sorted(members)) + f"|{max_step}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def lacks_majority(previous_members: Sequence[str], members: Sequence[str]) -> bool:
    """Whether a quorum after a lighthouse restart holds at most half of the groups of the last quorum before it (pure).

    A restarted lighthouse knows only the groups whose heartbeats reached it
    so far, and torchft's split-brain rule (a quorum needs more than half of
    the heartbeating groups) counts only those: right after a restart, one
    group alone can get a quorum while the others are still reconnecting, and
    each side then commits the same step on a different membership. Two
    quorums that each hold more than half of the same previous membership
    always share a group, so they cannot both commit apart.

    Args:
        previous_members: replica ids of the last quorum before the restart.
        members: replica ids of the new quorum.
    """
    before, now = {_group(m) for m in previous_members}, {_group(m) for m in members}
    return 2 * len(before & now) <= len(before)


def _group(replica_id: str) -> Union[int, str]:
    """The replica group of a torchft replica id (:func:`~ftbridge.manager.lighthouse_status.replica_group_of`;
    the UUID after it changes on a restart); an id of another form counts as a group of its own."""
    group = replica_group_of(replica_id)
    return replica_id if group is None else group


class RestartMajority:
    """After a lighthouse restart, which quorums may commit: one group's state (pure; the clock is passed in).

    From a detected restart until this group *commits* again, every quorum must
    hold more than half of the groups that last held the job's history with it
    (:func:`lacks_majority`); a quorum that lacks them is discarded. Seeing a
    quorum that holds them is not enough: if nothing commits there (a member
    errs, or this group's heal does not apply while the others commit), the
    next quorum may be this group alone at an older step, and the job's
    history before the restart no longer vouches for it (a restarted
    lighthouse numbers quorums anew, so the continuity of quorum ids does not
    reach back past it).

    Args:
        wait_s: seconds past which a lacking quorum sets :attr:`expired` (the group stops rather than train
            on a minority that may fork the job), counted from the restart, from the last quorum that held
            the majority, or from the end of a time the lighthouse did not answer (:meth:`unanswered`),
            whichever is latest: in each the groups before the restart could not come back, or did.
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
        """A lighthouse restart was detected at ``now``; ``before``: the replica ids that last held the job's
        history with this group (empty: no history, nothing is required)."""
        if self.pending is None and before:
            self.pending = (tuple(before), now)

    def unanswered(self, now: float) -> None:
        """The lighthouse did not answer this group for a while up to ``now`` (a quorum call outlived a try):
        nobody could join a quorum then, so the groups before the restart get the whole wait again from
        ``now``. Only delays a stop; what may commit is unchanged."""
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
        """The group committed a step (necessarily on a quorum that did not lack the majority): the requirement
        is met; from here the agreement's continuity of this lighthouse's quorum ids takes over."""
        self.pending, self.expired = None, False

