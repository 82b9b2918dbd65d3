"""The QUORUM and AGREE drivers of the commit protocol, one :class:`OutageRider` per rank.

QUORUM (torchft's quorum thread): group rank 0 decides whether the step rides
(:func:`~ftbridge.manager.commit.decide_ride`), or makes the lighthouse call in tries
(:meth:`OutageRider.ask`), which it leaves to ride when the lighthouse stops answering; the other ranks
follow rank 0 through the group's TCPStore. AGREE (every step): one SUM all-reduce of every member's
:class:`~ftbridge.manager.commit.View` (:meth:`OutageRider.agree`). Why: docs/concepts.md, "The commit
protocol"; docs/design.md, "Riding", "Continuity" and "The outage rider".
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from dataclasses import replace
from datetime import timedelta
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch.distributed import AllreduceOptions, ReduceOp

from ftbridge import faults
from ftbridge.log import RepeatLimit
from ftbridge.manager.commit import (
    ROW,
    Agreement,
    QuorumWait,
    View,
    decide_ride,
    encode_view,
    judge,
    membership_digest,
)
from ftbridge.manager.futures import in_thread
from ftbridge.manager.history import LastQuorum, QuorumHistory, Reused
from ftbridge.manager.lighthouse_monitor import LighthouseMonitor
from ftbridge.manager.torchft_api import replica_id_of
from ftbridge.manager.unseen import UnseenQuorums

logger = logging.getLogger(__name__)

POLL = timedelta(milliseconds=25)
"""How often rank 0 polls a lighthouse call in flight (the clock and the probe)."""

REPROBE = timedelta(milliseconds=500)
"""While a call is in flight, a lighthouse probe older than this is repeated."""

RETRY_GRACE = timedelta(milliseconds=200)
"""Pause before a lighthouse call's next try (docs/design.md, "The outage rider")."""

FRESH = timedelta(seconds=1)
"""At a step's start, a lighthouse probe started at most this long ago still counts."""

PACE = (timedelta(microseconds=500), timedelta(milliseconds=5))
"""First and longest pause between a following rank's reads of its rank 0's try count (:meth:`OutageRider._paced`)."""


class QuorumTimeout(RuntimeError):
    """No quorum within its deadline and riding was not possible: the rank exits, torchrun restarts the group."""


class TryNotMade(TimeoutError):
    """A rank other than group rank 0 did not make a try again: rank 0 had decided the step's call."""


class QuorumAnswerLost(RuntimeError):
    """This rank's copy of the quorum its group's rank 0 got was lost: the step is discarded."""


class OutageDisagreement(RuntimeError):
    """The members of this step's quorum did not agree on its view (or could not): the step is discarded."""


class OutageRider:
    """One rank's QUORUM and AGREE drivers (see the module docstring).

    Args:
        manager: torchft's ``Manager``; its internals are used (build only where
            :func:`ftbridge.manager.torchft_api.internals_supported` holds).
        enabled: riding is on (off: every step asks the lighthouse; the agreement still runs).
        lighthouse, replica_group_id, num_groups: the address; ids for logs and the agreement (0 groups:
            unknown, the continuity check always applies).
        group_rank, group_size: this rank in its replica group (0 decides), and the group's size.
        decision_timeout: how long a rank other than 0 waits for rank 0's decision or outcome.
        quorum_deadline: bound on one lighthouse call's wait, past which it counts as lost.
        quorum_timeout, tries: all tries of one call together, and their number (``quorum_retries + 1``, >= 1).
        monitor: group rank 0's lighthouse monitor (default: a 100 ms deadline).
        gap_wait, clock: ``restart_peer_wait`` before non-continuous quorums stop the group; monotonic seconds.
    """

    def __init__(self, manager: Any, *, enabled: bool, lighthouse: str, group_rank: int, group_size: int,
                 decision_timeout: timedelta, quorum_deadline: timedelta = timedelta(seconds=60),
                 quorum_timeout: timedelta = timedelta(seconds=30), tries: int = 1,
                 monitor: Optional[LighthouseMonitor] = None, replica_group_id: int = 0, num_groups: int = 0,
                 gap_wait: timedelta = timedelta(seconds=30), clock: Callable[[], float] = time.monotonic) -> None:
        self._manager = manager
        self._who = f"[replica {replica_group_id} rank {group_rank}]"
        self._repeats = RepeatLimit()
        self._back_at = float("-inf")  # monotonic time this group last went back to the lighthouse
        self.replica_group_id, self.num_groups = replica_group_id, num_groups
        self.enabled = enabled
        self._lighthouse = lighthouse
        self._monitor = monitor or LighthouseMonitor(lighthouse, deadline=timedelta(milliseconds=100))
        self._group_rank, self._group_size = group_rank, group_size
        self._decision_timeout, self._quorum_deadline = decision_timeout, quorum_deadline
        if tries < 1:
            raise ValueError(f"tries={tries} must be >= 1 (quorum_retries + 1)")
        self._tries, self._try_timeout = tries, quorum_timeout / tries
        self.unanswered_tries = 0
        self.lost_answers = 0
        """Steps this rank (not group rank 0) discarded because its copy of rank 0's answer was lost
        (:meth:`_lost_answer`)."""
        self.lost = False
        """This step's quorum is the last one again because this rank's answer was lost: nothing of it is new."""
        self._made = 0  # tries of this step's call that reached torchft's manager server (ranks other than 0)
        self._numbered = (0, 0)  # (step seq, tries numbered in it): a following rank's pacing (_number_try)
        self.last: Optional[LastQuorum] = None
        self._members: Tuple[str, ...] = ()
        self.history = QuorumHistory(gap_wait.total_seconds(), clock)
        """The quorums since the last certified one (the agreement row's continuity fields)."""
        self.unseen = UnseenQuorums(lighthouse, self.history, self._who, me=lambda: replica_id_of(manager))
        """Quorums issued to a timed-out try of this rank's call (:mod:`ftbridge.manager.unseen`)."""
        self._timed_out = False  # a try timed out and no quorum came since: its request may still be issued
        self._left_call: Optional[concurrent.futures.Future] = None  # the last lighthouse call this rank left
        self._adopted: Optional[concurrent.futures.Future] = None  # ... taken up again as a later step's call
        self.riding = False
        """Whether the current step reuses the last quorum."""
        self._seen = True  # the lighthouse answered this group at this step's start (the agreement row)
        self._last_committed = False
        self._last_ride_on = False
        self._rode_last = False
        self._seq = 0
        self.rides = 0
        """Steps that reused a quorum."""
        self.ride_commits = 0
        """Of those, steps committed."""
        self.disagreements = 0
        """Agreements that did not pass (each discarded a step)."""
        self.skipped_collective: Callable[[], bool] = lambda: manager.errored() is not None
        """Whether this rank's collectives of this step may no longer pair with its peers' (set by
        :class:`ftbridge.manager.ReplicaManager`)."""

    @classmethod
    def for_config(cls, manager: Any, cfg: Any) -> "OutageRider":
        """The rider of one rank from its :class:`ftbridge.config.FTBridgeConfig`."""
        monitor = LighthouseMonitor(cfg.lighthouse, deadline=cfg.lighthouse_probe_timeout)
        return cls(manager, enabled=cfg.ride_out_lighthouse_outage, lighthouse=cfg.lighthouse,
                   group_rank=cfg.group_rank, group_size=cfg.group_size, decision_timeout=cfg.quorum_timeout,
                   quorum_deadline=cfg.quorum_timeout + cfg.connect_timeout + timedelta(seconds=5),
                   quorum_timeout=cfg.quorum_timeout, tries=cfg.quorum_retries + 1,
                   monitor=monitor, replica_group_id=cfg.replica_group_id, num_groups=cfg.num_replica_groups,
                   gap_wait=cfg.restart_peer_wait)

    # -- QUORUM (torchft's quorum thread) --------------------------------------------------------------
    def quorum(self, call: Callable[[timedelta], Any]) -> Any:
        """This step's quorum: the last one reused (:meth:`reuse`), or the answer to ``call(timeout)`` (:meth:`ask`);
        :attr:`riding` tells which."""
        reused = self.reuse()
        return reused if reused is not None else self.ask(call)

    def remember(self, result: Any, replica_ids: Sequence[str]) -> None:
        """Keep ``result``, the quorum torchft is about to use, for riding, and close the history of the one before
        (certified, missed or dead end)."""
        qid, members, last = int(result.quorum_id), tuple(sorted(replica_ids)), self.last
        self._timed_out = False
        self.history.close(None if last is None else (last.quorum_id, self._members), (qid, members))
        self.last, self._members = LastQuorum(result, qid, membership_digest(replica_ids), int(result.replica_rank),
                                              int(result.replica_world_size)), members

    @property
    def gap_expired(self) -> bool:
        """Non-continuous quorums have been discarded for longer than ``gap_wait`` (met steps only,
        :meth:`after_commit`)."""
        return self.history.gap_expired

    def _left(self, future: concurrent.futures.Future) -> None:
        """The group left this call to ride: its quorum, whenever it comes, is a dead end."""
        epoch = self.history.epoch
        self._left_call = future

        def note(done: concurrent.futures.Future) -> None:
            if done.cancelled() or done.exception() is not None:
                return
            qid = int(getattr(done.result(), "quorum_id", -1))
            with self.history.lock:
                if done is not self._adopted:
                    self.history.never_joined(epoch, qid, None if self.last is None else self.last.quorum_id)

        future.add_done_callback(note)

    def holding(self) -> bool:
        """Whether a lighthouse call this rank left to ride is still in flight (:attr:`View.holding`); it ends by its
        try's deadline."""
        call = self._left_call
        return call is not None and not call.done()

    def _take_up_left(self) -> Optional[concurrent.futures.Future]:
        """The left call if still in flight (this step waits on it instead of a new call), else ``None``."""
        with self.history.lock:
            call = self._left_call
            if call is None or call.done():
                return None
            self._adopted, self._left_call = call, None
            return call

    def certified_members(self) -> Tuple[str, ...]:
        """Replica ids of the newest quorum in which an agreement of this rank passed (empty: none); the quorum guard's
        majority rule after a lighthouse restart counts them."""
        return self.history.certified_members(self._members)

    def may_ride(self) -> bool:
        """Whether this step may ride: riding is on, the group committed the last step, and torchft still holds the last
        quorum's process group."""
        last = self.last
        return (self.enabled and last is not None and self._last_committed
                and int(self._manager._quorum_id) == last.quorum_id)

    def leave_call(self) -> Any:
        """Leave this step's lighthouse call (rank 0 found the lighthouse not answering) and ride."""
        self._seen = False
        return self._ride()

    def reuse(self) -> Optional[Any]:
        """This step's quorum result if it rides from its start, else ``None``; once per step on every rank, before the
        lighthouse call.

        Raises:
            QuorumTimeout: rank 0 rides but this rank holds no matching quorum, or the decision could not be shared.
        """
        self._seq += 1
        self.riding, self._seen, self.unanswered_tries, self.lost = False, True, 0, False
        if not self.enabled:
            return None
        ride, seen = self._decide() if self._group_rank == 0 else (False, True)
        if self._group_size > 1:
            ride, seen = self._share(ride, seen)
        self._seen = seen
        if ride and not self.may_ride():
            raise QuorumTimeout(f"{self._who} the group rides out a lighthouse outage but this rank holds no "
                                "matching quorum: its ranks disagree on the last quorum")
        return self._ride() if ride else None

    def _ride(self) -> Reused:
        assert self.last is not None
        self.riding = True
        self.rides += 1
        return Reused(self.last, int(self._manager.current_step()))

    def _decide(self) -> Tuple[bool, bool]:
        """Group rank 0: ``(ride, lighthouse seen)`` for this step."""
        last = self.last
        # A probe from before the group went back to the lighthouse was overruled by the member that heard it:
        # riding again alone on it would leave the others on a new quorum for a cross-replica timeout.
        since = max(time.monotonic() - FRESH.total_seconds(), self._back_at)
        answers = self._monitor.answers(since=since) if self.may_ride() else None
        ride = decide_ride(enabled=self.enabled, has_last=last is not None,
                           same_process_group=last is not None and int(self._manager._quorum_id) == last.quorum_id,
                           last_committed=self._last_committed, rode_last=self._rode_last,
                           last_ride_on=self._last_ride_on, lighthouse_answers=answers)
        if ride and not self._rode_last:
            self._warn("ride", "%s lighthouse %s does not answer: committing on the last quorum (id %d, %d members) "
                       "while no group fails", self._who, self._lighthouse, last.quorum_id if last else -1,
                       last.world_size if last else 0)
        elif self._rode_last and not ride:
            self._back_at = time.monotonic()
            self._warn("back", "%s back to the lighthouse (%d steps without it so far) on quorum %d (%s)", self._who,
                       self.rides, last.quorum_id if last else -1,
                       "a member hears it again" if self._last_committed else "a riding step failed")
        return ride, (answers is True) if ride else True

    def _share(self, ride: bool, seen: bool) -> Tuple[bool, bool]:
        """Rank 0's ``(ride, seen)``, shared on the group's TCPStore.

        Raises:
            QuorumTimeout: the store failed, or rank 0's decision did not come within the decision timeout.
        """
        store, key = self._manager._store, f"ftbridge/outage/{self._seq}"
        try:
            if self._group_rank == 0:
                store.set(key, bytes([48 + ride, 48 + seen]))
                if self._seq > 2:  # every rank has read it: they all passed the last step's should_commit
                    for suffix in ("", "/outcome", "/unseen", "/made"):
                        store.delete_key(f"ftbridge/outage/{self._seq - 2}{suffix}")
                return ride, seen
            store.wait([key], self._decision_timeout)
            value = bytes(store.get(key))
            return value[:1] == b"1", value[1:2] == b"1"
        except Exception as exc:
            raise QuorumTimeout(f"{self._who} the replica group's ranks could not share this step's quorum "
                                f"decision on the group's store ({type(exc).__name__}: {exc}): a rank of the group "
                                "is gone or hung") from exc

    def ask(self, call: Callable[[timedelta], Any]) -> Any:
        """This step's lighthouse call, one try at a time in a helper thread; rank 0 rides instead if the lighthouse
        stops answering.

        A try left to ride is taken up by the next asking step, never doubled; a timed-out try or a stale answer
        is tried again, up to ``tries``; with riding on, the other ranks follow rank 0's published outcome.

        Raises:
            Whatever the last try raises (torchft's ``TimeoutError`` included); :class:`QuorumTimeout` past the
            quorum deadline, or when rank 0's outcome does not come in time.
        """
        future = self._take_up_left()
        self._made = int(future is not None)  # a try taken up was made at an earlier step
        if future is not None:
            self._warn("take-up", "%s a lighthouse call this group left to ride is still in flight: this step "
                       "waits on it (its request holds the step it was made at) instead of a second call",
                       self._who)
        else:
            future = self._try(call)
        if self.enabled and self._group_rank != 0:
            return self._follow(future, call)
        wait = QuorumWait(started=time.monotonic(), deadline_s=self._quorum_deadline.total_seconds(),
                          may_ride=self.enabled and self.may_ride())
        tried = 1
        while True:
            done, _ = concurrent.futures.wait([future], timeout=POLL.total_seconds())
            if done:
                following = self._next_try(future, call, tried)
                if following is not None:
                    future, tried = following
                    continue
                self._publish(self._asked(future.result()) if future.exception() is None else b"failed")
                return future.result()
            now = time.monotonic()
            answers = (self._monitor.answers(since=max(wait.started, now - REPROBE.total_seconds()))
                       if wait.may_ride else None)
            action = wait.poll(now, answers)
            if action == QuorumWait.RIDE:
                self._publish(b"rode")
                self._left(future)
                self._warn("leave", "%s lighthouse %s does not answer a quorum call in flight: leaving it and "
                           "committing on the last quorum (id %d)", self._who, self._lighthouse,
                           self.last.quorum_id if self.last else -1)
                return self.leave_call()
            if action == QuorumWait.EXPIRED:
                self._publish(b"failed")
                raise QuorumTimeout(f"{self._who} the lighthouse call did not end within "
                                    f"{wait.deadline_s:g} s (quorum timeout + connect timeout + 5 s)")

    def _try(self, call: Callable[[timedelta], Any], after: timedelta = timedelta(0),
             unless: Optional[Callable[[], bool]] = None, paced: bool = True) -> concurrent.futures.Future:
        """One try in a helper thread, started ``after`` from now; ends with :class:`TryNotMade` if ``unless()`` holds
        by then. With riding on, rank 0 counts its tries on the group's store and the other ranks make each of theirs
        after rank 0's (:meth:`_paced`), unless ``paced`` is false (a try made after rank 0's outcome)."""
        seq, number = self._seq, self._number_try() if paced else 0

        def run() -> Any:
            if self._timed_out:
                self._look_for_unseen()
            if after:
                time.sleep(after.total_seconds())  # a retry's back-off: the last try's server side ends first
            if self._timed_out:
                self._look_for_unseen()  # right before the request replaces the timed-out one at the lighthouse
            if number:
                self._paced(seq, number)
            if unless is not None and unless():
                raise TryNotMade("rank 0 of the group decided this step's quorum call first")
            self._made += 1
            if self.enabled and self._group_size > 1 and self._group_rank == 0:
                self._count_try(seq)
            return call(self._try_timeout)

        future = in_thread(run, "ftbridge-quorum-call")
        if faults.armed("in_quorum_call"):  # chaos and tests: this rank pauses with its try in flight
            where = f"quorum call {self._seq}"

            def freeze() -> None:
                if not future.done():
                    faults.point("in_quorum_call", where)

            threading.Timer(0.005, freeze).start()
        return future

    def _number_try(self) -> int:
        """A following rank's next try of this step's call: its number among the step's tries (1, 2, ...); 0 for rank 0,
        a group of one, or riding off (no pacing)."""
        if not (self.enabled and self._group_size > 1 and self._group_rank != 0):
            return 0
        count = self._numbered[1] + 1 if self._numbered[0] == self._seq else 1
        self._numbered = (self._seq, count)
        return count

    def _count_try(self, seq: int) -> None:
        """Group rank 0, right before it makes a try of step ``seq``'s call: counts it on the group's store for the
        ranks that follow (:meth:`_paced`). A store error is logged: those ranks then make no try until rank 0's
        outcome, and lose their copy of its answer (:meth:`_lost_answer`)."""
        try:
            self._manager._store.add(f"ftbridge/outage/{seq}/made", 1)
        except Exception as exc:  # noqa: BLE001 - the stated outcome above; the call itself goes ahead
            logger.error("%s could not count this step's quorum try on the group's store (%s)", self._who, exc)

    def _paced(self, seq: int, number: int) -> None:
        """A rank other than 0: wait until rank 0 made its ``number``-th try of step ``seq``'s call, so this rank's
        try reaches torchft's manager server after rank 0's and its deadline is the later one: an answer rank 0 gets
        reaches this rank too (docs/design.md, "The outage rider", "Tries in step").

        Raises:
            TryNotMade: rank 0 published its outcome first, or made no such try within the quorum deadline plus the
                decision timeout (this try is not made).
        """
        store = self._manager._store
        key, outcome = f"ftbridge/outage/{seq}/made", f"ftbridge/outage/{seq}/outcome"
        end = time.monotonic() + (self._quorum_deadline + self._decision_timeout).total_seconds()
        pause = PACE[0].total_seconds()
        while int(store.add(key, 0)) < number:
            if store.check([outcome]):
                raise TryNotMade("rank 0 of the group decided this step's quorum call first")
            if time.monotonic() > end:
                raise TryNotMade(f"rank 0 of the group made no try {number} of this step's quorum call in time")
            time.sleep(pause)
            pause = min(2 * pause, PACE[1].total_seconds())

    def _stale_answer(self, result: Any) -> bool:
        """Whether the first answer after a cleanly left ride counts a member of the ridden quorum behind (an earlier
        try's request): ask again."""
        if not (self._rode_last and self._last_committed) or bool(getattr(result, "heal", False)):
            return False
        ridden = sum(1 for rid in list(getattr(result, "replica_ids", []) or []) if rid in self._members)
        stale = int(getattr(result, "max_world_size", ridden)) < ridden
        if stale:
            self._warn("stale", "%s the lighthouse's first quorum after the ride (id %s) counts a member of the "
                       "ridden quorum behind this group: an earlier try's request, whose owner does not wait for "
                       "it; asking again", self._who, getattr(result, "quorum_id", "?"))
        return stale

    def _next_try(self, future: concurrent.futures.Future, call: Callable[[timedelta], Any],
                  tried: int, unless: Optional[Callable[[], bool]] = None
                  ) -> Optional[Tuple[concurrent.futures.Future, int]]:
        """``(next try, tried + 1)`` for a try that timed out or got a stale answer while tries remain; ``None`` when it
        is the outcome."""
        exc = future.exception()
        if isinstance(exc, TimeoutError) and not isinstance(exc, TryNotMade):
            self._timed_out = True
        if tried >= self._tries:
            return None
        if exc is not None:
            if not isinstance(exc, TimeoutError) or isinstance(exc, TryNotMade):
                return None
            self.unanswered_tries += 1
            return self._try(call, after=RETRY_GRACE, unless=unless), tried + 1
        return (self._try(call), tried + 1) if self._stale_answer(future.result()) else None

    @staticmethod
    def _asked(result: Any) -> bytes:
        """Rank 0's outcome ``b"asked <quorum id> <membership digest>"``."""
        ids = list(getattr(result, "replica_ids", []) or [])
        return f"asked {int(getattr(result, 'quorum_id', -1))} {membership_digest(ids)}".encode()

    def _warn(self, key: str, msg: str, *args: Any) -> None:
        """A ride transition's warning, at most one per ``key`` every 30 s, with the count held back."""
        held = self._repeats.allow(key, time.monotonic())
        if held is not None:
            logger.warning(msg + (f" ({held} more like this since the last one logged)" if held else ""), *args)

    def _look_for_unseen(self) -> None:
        """A try of this rank's call timed out: record the quorum the lighthouse issued to it, if any. A rank that
        follows its rank 0 takes rank 0's findings instead (:meth:`UnseenQuorums.adopt`)."""
        following = self.enabled and self._group_size > 1 and self._group_rank != 0
        if self.last is not None and not following:
            self.unseen.look(self.last.quorum_id, self.last.quorum_id)

    def _publish(self, outcome: bytes) -> None:
        if self.enabled and self._group_size > 1:
            try:
                self.unseen.share(self._manager._store, f"ftbridge/outage/{self._seq}/unseen")  # before the outcome
                self._manager._store.set(f"ftbridge/outage/{self._seq}/outcome", outcome)
            except Exception as exc:  # noqa: BLE001 - the others then time out waiting for it and fail the step
                logger.error("%s could not publish this step's quorum outcome (%s)", self._who, exc)

    def _follow(self, future: concurrent.futures.Future, call: Callable[[timedelta], Any]) -> Any:
        """A rank other than 0: act on rank 0's outcome, never on its own call alone; try again while rank 0 may need
        it."""
        key = f"ftbridge/outage/{self._seq}/outcome"
        store, bound = self._manager._store, self._quorum_deadline + self._decision_timeout
        end, tried = time.monotonic() + bound.total_seconds(), 1

        def decided() -> bool:  # a try made after rank 0's outcome would wait at torchft's server for a next round
            return bool(store.check([key]))

        try:
            while not store.check([key]):
                done, _ = concurrent.futures.wait([future], timeout=POLL.total_seconds())
                following = self._next_try(future, call, tried, unless=decided) if done else None
                if following is not None:
                    future, tried = following
                elif done or time.monotonic() > end:  # nothing more to try here: wait for rank 0's word
                    store.wait([key], timedelta(seconds=max(end - time.monotonic(), 0.001)))
            outcome = bytes(store.get(key))
        except Exception as exc:
            raise QuorumTimeout(f"{self._who} replica group rank 0's quorum outcome did not come within "
                                f"{bound.total_seconds():g} s ({type(exc).__name__}: {exc})") from exc
        self.unseen.adopt(store, f"ftbridge/outage/{self._seq}/unseen", None if self.last is None else
                          self.last.quorum_id)
        if outcome == b"rode":
            self._left(future)
            return self.leave_call()
        if outcome == b"failed":
            raise QuorumTimeout(f"{self._who} replica group rank 0's lighthouse call failed this step")
        while True:
            done, _ = concurrent.futures.wait([future], timeout=self._decision_timeout.total_seconds())
            if not done:
                raise QuorumTimeout(f"{self._who} rank 0 got this step's quorum but this rank's call did not "
                                    f"end within {self._decision_timeout.total_seconds():g} s")
            if future.exception() is None and tried < self._tries and self._stale_answer(future.result()):
                future, tried = self._try(call, paced=False), tried + 1  # rank 0 asked again: its try needs this one
                continue
            lost = future.exception()
            if isinstance(lost, TimeoutError) and self._made == 1:
                return self._lost_answer(lost, outcome)
            return future.result()

    def _lost_answer(self, exc: BaseException, outcome: bytes) -> Any:
        """Rank 0 got ``outcome`` and this rank's one try timed out first: discard the step (:class:`QuorumAnswerLost`)
        on the quorum it holds.

        Raises:
            QuorumTimeout: rank 0's quorum is not the one this rank holds.
        """
        last, words = self.last, outcome.split()
        same = (last is not None and len(words) == 3 and words[1] == str(last.quorum_id).encode()
                and words[2] == last.digest.encode() and int(self._manager._quorum_id) == last.quorum_id)
        if not same:
            raise QuorumTimeout(f"{self._who} rank 0 got this step's quorum ({outcome.decode(errors='replace')}), "
                                f"this rank's copy of it was lost ({exc}), and it is not the quorum this rank "
                                "holds") from exc
        assert last is not None
        self.lost_answers += 1
        logger.warning("%s this rank's copy of the quorum its rank 0 got was lost (%s; a pause of the process "
                       "longer than one try, %g s?): the group discards this step and asks again", self._who, exc,
                       self._try_timeout.total_seconds())
        self._manager.report_error(QuorumAnswerLost(f"{self._who} lost its copy of this step's quorum"))
        self.lost = True
        return Reused(last, int(self._manager.current_step()))

    # -- AGREE (training thread) ---------------------------------------------------------------------
    def agree(self, guard: Optional[str] = None, empty: bool = False, plan: int = 0,
              borrowed: bool = False) -> Agreement:
        """Agree with every member of this step's quorum on its view; every rank, every step, right before the group's
        decision. Never raises.

        ``guard``: this rank's fingerprint when the guard is due; ``empty``: the group joined with nothing;
        ``plan``, ``borrowed``: :attr:`~ftbridge.manager.commit.View.plan`,
        :attr:`~ftbridge.manager.commit.View.borrowed`.
        """
        own = self.own_row(guard, empty, plan, borrowed)
        if own is None:
            return self.conclude(None, None, "this rank's collectives of this step did not all run")
        rows, failure = self._exchange(own)
        return self.conclude(own, rows, failure)

    def own_row(self, guard: Optional[str] = None, empty: bool = False, plan: int = 0,
                borrowed: bool = False) -> Optional[List[float]]:
        """This member's agreement row, or ``None`` when it cannot take part (no quorum, a process group not the last
        quorum's or failed, a collective of this step skipped)."""
        m, last = self._manager, self.last
        if last is None or int(m._quorum_id) != last.quorum_id or m._pg.errored() is not None \
                or self.skipped_collective():
            return None
        participating, participants, h = bool(m.is_participating()), int(m.num_participants()), self.history
        # torchft's should_commit refuses below min_replica_size without recording an error: such a row is not ok,
        # or a member would count the others as committing a step nobody commits (a "missed" quorum).
        enough = participants >= int(getattr(m, "_min_replica_size", 1))
        return encode_view(View(self.replica_group_id, last.quorum_id, last.digest, int(m.current_step()),
                                participants, participating, m.errored() is None and enough, self._seen,
                                guard if participating else None, h.certified, h.dead_ends(), empty,
                                self.num_groups, h.missed, h.certified_committers, self.holding(), plan,
                                borrowed and not empty, self.riding, h.behind))

    def conclude(self, own: Optional[List[float]], rows: Optional[List[List[float]]], failure: str) -> Agreement:
        """The verdict on the summed rows (``rows`` ``None``: the all-reduce failed, for ``failure``); a verdict that
        does not commit records an error with torchft."""
        m, last = self._manager, self.last
        verdict = (replace(judge(rows, own, riding=self.riding), shared=True) if own is not None and rows is not None
                   else Agreement(False, False, False, failure, shared=own is None))
        self.history.agreed(verdict, rows, last.replica_rank if last is not None else 0)
        if not verdict.commit and m.errored() is None:
            self.disagreements += 1
            m.report_error(OutageDisagreement(
                f"step {int(m.current_step())} on quorum {last.quorum_id if last else -1} "
                f"{'without the lighthouse' if self.riding else 'from the lighthouse'}: {verdict.reason}"))
        return verdict

    def _exchange(self, own: List[float]) -> Tuple[Optional[List[List[float]]], str]:
        m, last = self._manager, self.last
        assert last is not None
        try:
            rows = torch.zeros(last.world_size, ROW, dtype=torch.float64)
            rows[last.replica_rank] = torch.tensor(own, dtype=torch.float64)
            opts = AllreduceOptions()
            opts.reduceOp = ReduceOp(ReduceOp.SUM)
            # Never cut short (the peer watch cuts only gradient waits): this all-reduce is where the step is
            # decided, and a member that left it after adding its row could discard a step the others commit.
            m._pg.allreduce([rows], opts).wait()
            return rows.tolist(), ""
        except Exception as exc:  # noqa: BLE001 - a member died or hung: discard, back to the lighthouse
            return None, f"agreement all-reduce failed: {type(exc).__name__}: {exc}"

    def after_commit(self, committed: bool, ride_next: bool, nobody_commits: bool = False,
                     group_agreed: bool = True, group_met: bool = True) -> None:
        """Record the group's decision (the same on every rank) for the next step and the quorum history.

        ``committed``: the group committed; ``ride_next``, ``nobody_commits``, ``group_agreed``, ``group_met``:
        :class:`~ftbridge.manager.commit.GroupDecision`'s ``ride_next``, ``nobody_commits``, ``agreed`` (only then
        is a discard a missed step) and ``met`` (only then does the step count towards ``gap_wait``).
        """
        self._last_committed = committed
        self.history.decided(committed, group_agreed, nobody_commits, group_met)
        self._rode_last = self.riding
        if self.riding and committed:
            self.ride_commits += 1
        self._last_ride_on = self.riding and ride_next
