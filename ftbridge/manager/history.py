"""What one rank remembers of quorums: the last one (:class:`LastQuorum`, what a riding step reuses as
:class:`Reused`) and the history since the last certified one (:class:`QuorumHistory`).

Pure state, no I/O: the outage rider (:mod:`ftbridge.manager.outage`) feeds it each quorum change, each
agreement's verdict and each group decision, and reads back the agreement row's history fields
(:attr:`~ftbridge.manager.commit.View.certified`, ``dead_ends``, ``missed``, ``committers``) and whether
non-continuous quorums have lasted past ``restart_peer_wait``. Why: docs/design.md, "Continuity".
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

from ftbridge.manager.commit import DEAD_END_RUNS, ROW_OK, ROW_STEP, Agreement, id_runs
from ftbridge.manager.quorum_rules import QuorumSeen, detect_lighthouse_restart


@dataclass(frozen=True)
class LastQuorum:
    """The last quorum this rank got from the lighthouse (what a riding step reuses): torchft's ``result``, its
    ``quorum_id``, membership ``digest``, this group's ``replica_rank`` in it and its ``world_size`` (the process
    group's rank and size)."""

    result: Any
    quorum_id: int
    digest: str
    replica_rank: int
    world_size: int


class Reused:
    """``last``'s quorum result for a step that rides (at ``step``): nothing to heal, every member participating."""

    heal = False
    recover_src_manager_address = ""
    recover_src_replica_rank = None
    recover_dst_replica_ranks: List[int] = []

    def __init__(self, last: LastQuorum, step: int) -> None:
        self._result = last.result
        self.max_step = step
        self.max_replica_rank = last.replica_rank
        self.max_world_size = last.world_size

    def __getattr__(self, name: str) -> Any:
        return getattr(self._result, name)


class QuorumHistory:
    """The quorums since the last certified one, as one rank saw them (thread-safe where a late answer writes).

    Args:
        gap_wait_s: ``restart_peer_wait`` in seconds: non-continuous quorums discarded for longer set
            :attr:`gap_expired`.
        clock: monotonic seconds.
    """

    def __init__(self, gap_wait_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.lock = threading.Lock()
        """Guards :attr:`dead` and :attr:`epoch` against a left lighthouse call answered late (another thread)."""
        self.certified = -1
        """Newest quorum id in which this group committed a step that passed continuity (-1: none)."""
        self.dead: set = set()
        """Quorum ids after :attr:`certified` in which this group committed nothing and nobody committed."""
        self.epoch = 0
        """Lighthouse restarts seen: an answer from before one belongs to no history of this one."""
        self.missed = -1
        """The quorum id in which others may have committed while this group discarded (-1: none)."""
        self.certified_committers = 0
        """Members whose row was ok in the step that certified :attr:`certified`."""
        self.behind = 0
        """After a lighthouse restart, until this group commits: the steps a member must hold for a quorum that does
        not hold the whole job to commit, 1 + the newest step this group missed before the restart (0: none). Quorum
        ids start anew there, so :attr:`missed` cannot say it; steps can."""
        self.gap_expired = False
        """Non-continuous quorums have been discarded for longer than ``gap_wait_s`` (met steps only)."""
        self._gap_wait, self._clock = gap_wait_s, clock
        self._before: Tuple[str, ...] = ()  # members of the newest certified quorum before the current one
        self._passed = False  # an agreement of the current quorum passed continuity
        # In the current quorum, the latest step whose agreement passed and that anyone may have committed:
        self.held = False
        """... this group committed it."""
        self.missed_here = False
        """... this group discarded it while another member's row was ok."""
        self._agreed = False  # this step's agreement passed continuity
        self._oks = self._others_ok = 0  # rows ok in it (a member whose row is not ok discards): all, all but own
        self._committers = 0  # _oks of the step that set held
        self._step = -1  # the step of this step's agreement (its members' step)
        self._missed_step = -1  # the newest step this group missed since it last certified a quorum (-1: none)
        self._gap_mark: Optional[float] = None  # end of the last counted step of a gap (None: no gap)
        self._gap_s = 0.0  # seconds of the gap counted so far

    def close(self, last: Optional[Tuple[int, Sequence[str]]], new: Tuple[int, Sequence[str]]) -> None:
        """The quorum changes from ``last`` to ``new`` (each ``(quorum id, sorted members)``; ``last`` ``None``:
        the first): record how the last one ended (certified, missed or dead end)."""
        if last is None or tuple(last[1]) == tuple(new[1]) and last[0] == new[0]:
            return
        self._before = self.certified_members(last[1])
        with self.lock:
            self.dead.discard(new[0])  # issued again, now to a call the group acts on: no longer a dead end
            if detect_lighthouse_restart(QuorumSeen(last[0], tuple(last[1])), new[0], tuple(new[1])):
                self.certified, self.dead, self.epoch = -1, set(), self.epoch + 1  # ids start anew
                self.missed, self.certified_committers = -1, 0  # RestartMajority holds the history across it
                self.behind = max(self.behind, self._missed_step + 1)  # and the step it missed, by its number
                self._missed_step = -1
            elif self.held:
                self.certified, self.missed, self.certified_committers = last[0], -1, self._committers
                self._missed_step = -1
                self.dead = {k for k in self.dead if k > last[0]}
            elif self.missed_here:
                self.missed = last[0]  # others may have committed there; this group stayed behind
            else:
                self.dead.add(last[0])  # nobody committed there
        self._passed = self.held = self.missed_here = False

    def dead_ends(self) -> Tuple[Tuple[int, int], ...]:
        """:attr:`dead` as runs of consecutive ids, newest first (:attr:`~ftbridge.manager.commit.View.dead_ends`)."""
        with self.lock:
            return id_runs(self.dead, DEAD_END_RUNS)

    def never_joined(self, epoch: int, quorum_id: int, current: Optional[int]) -> None:
        """The lighthouse (in ``epoch``) issued ``quorum_id`` to a call of this group that the group never acted on (a
        call left to ride, answered late; a try that timed out): nobody commits there, a dead end unless it is
        ``current``, the quorum the rank holds now. Call with :attr:`lock` held."""
        if epoch == self.epoch and quorum_id > self.certified and quorum_id != current:
            self.dead.add(quorum_id)

    def certified_members(self, members: Sequence[str]) -> Tuple[str, ...]:
        """Members of the newest quorum in which an agreement of this rank passed: ``members`` (the current quorum's)
        if one passed in it, else those of an earlier one (empty: none)."""
        return tuple(members) if self._passed else self._before

    def agreed(self, verdict: Agreement, rows: Optional[Sequence[Sequence[float]]], own_index: int) -> None:
        """Record this step's agreement: its ``verdict`` on the summed ``rows`` (this member's row at ``own_index``)."""
        self._passed |= verdict.continuous
        self._agreed = verdict.continuous
        if verdict.continuous and rows is not None:
            self._step = int(rows[own_index][ROW_STEP])
            self._oks = sum(row[ROW_OK] == 1.0 for row in rows)
            self._others_ok = self._oks - (rows[own_index][ROW_OK] == 1.0)
        if verdict.consistent and not verdict.continuous:
            now = self._clock()
            self._gap_s += now - (now if self._gap_mark is None else self._gap_mark)
            self._gap_mark = now
            self.gap_expired = self._gap_s >= self._gap_wait
        elif verdict.continuous:
            self._gap_mark, self._gap_s, self.gap_expired = None, 0.0, False

    def decided(self, committed: bool, group_agreed: bool, nobody_commits: bool, group_met: bool) -> None:
        """Record the group's decision on this step (see :meth:`ftbridge.manager.outage.OutageRider.after_commit`)."""
        if not group_met and self._gap_mark is not None:
            self._gap_mark = self._clock()
        if committed:
            self.behind = 0  # past the restart: the history of the quorums since then decides
        if self._agreed and committed:
            self.held, self.missed_here, self._committers = True, False, self._oks
        elif self._agreed and self._others_ok and group_agreed and not nobody_commits:
            self.held, self.missed_here, self._missed_step = False, True, self._step
        self._agreed, self._oks, self._others_ok = False, 0, 0

