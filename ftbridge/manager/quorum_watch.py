"""The peer watch: cut a hung peer off once the lighthouse declares it dead (gloo process groups only).

A wait on a cross-replica all-reduce longer than ``peer_watch_poll`` reads the lighthouse's ``/status`` every
poll; once a member of the step's quorum is stale, the step is discarded (:class:`PeerLost`), the all-reduce
abandoned and the process group rebuilt by the next quorum. A resumed rank frozen during the step discards it.
Why: docs/concepts.md, "The timeout hierarchy"; docs/design.md, "The peer watch".
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple

import torch
from torch.distributed import DistStoreError

from ftbridge.manager.futures import in_thread
from ftbridge.manager.lighthouse_status import LighthouseStatus, fetch_status

logger = logging.getLogger(__name__)


class PeerLost(RuntimeError):
    """A member of this step's quorum is dead according to the lighthouse: the step is discarded."""


def group_of(replica_id: str) -> str:
    """The replica group part of a torchft replica id (``replica_group_1:UUID`` -> ``replica_group_1``)."""
    return replica_id.split(":", 1)[0]


def lost_members(members: Sequence[str], me: str, stale: Iterable[str]) -> Tuple[str, ...]:
    """Sorted members (``replica_group_G:UUID``) other than group ``me`` whose id is in ``stale`` (pure)."""
    dead = set(stale)
    return tuple(sorted(m for m in members if group_of(m) != me and m in dead))


def dropped_from_quorum(step_quorum_id: int, me: str, lighthouse_quorum_id: int,
                        lighthouse_members: Sequence[str]) -> bool:
    """Whether the lighthouse's quorum is later than ``step_quorum_id`` and excludes group ``me`` (pure)."""
    return lighthouse_quorum_id > step_quorum_id and all(group_of(m) != me for m in lighthouse_members)


def stale_ids(status: LighthouseStatus) -> List[str]:
    """Replica ids the lighthouse marks stale in ``status``."""
    return [h.replica_id for h in status.heartbeats if h.stale]


def fetch_status_bounded(address: str, timeout: timedelta) -> LighthouseStatus:
    """:func:`ftbridge.manager.lighthouse_status.fetch_status` of ``address`` within ``timeout``.

    Raises:
        OSError: unreachable or an HTTP error.
        StatusFormatError: not torchft 0.2's status fragment, or a page over the bound.
    """
    return fetch_status(address, timeout_s=timeout.total_seconds())


class FreezeClock:
    """Notices that this process was frozen (SIGSTOP, a stuck host): a daemon thread ticks every ``tick``;
    ``clock`` gives monotonic seconds (a test seam)."""

    def __init__(self, tick: timedelta = timedelta(milliseconds=100),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._tick = tick.total_seconds()
        self._clock = clock
        self._last = clock()
        self._gaps: List[Tuple[float, float]] = []  # (end, length) of ticks late by more than a tick
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        """Start ticking (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ftbridge-freeze-clock", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._tick):
            self.tick()

    def tick(self) -> None:
        """Record one tick (the thread calls it; tests call it directly)."""
        now = self._clock()
        with self._lock:
            late = now - self._last - self._tick
            if late > self._tick:
                self._gaps = [g for g in self._gaps if g[0] > now - 600][-16:] + [(now, late)]
            self._last = now

    def frozen_since(self, since: float) -> float:
        """Longest freeze (s) that ended after ``since`` (monotonic s), including one still going on."""
        self.tick()
        with self._lock:
            return max([length for end, length in self._gaps if end > since], default=0.0)

    def stop(self) -> None:
        """Stop the thread."""
        self._stop.set()


class QuorumWatch:
    """One rank's watch over its cross-replica waits.

    Args:
        lighthouse: the lighthouse address (``http://HOST:PORT``).
        me: this replica group's id without the UUID (``replica_group_G``).
        quorum: returns ``(quorum_id, member replica ids)`` of this step's quorum, or ``None`` before the first.
        poll: delay before the first look at the lighthouse, then between looks (> 0).
        fetch: returns the lighthouse status (default :func:`fetch_status_bounded`, ``min(1 s, 4 x poll)``).
        freeze: the freeze detector (default: a started :class:`FreezeClock`).
        freeze_discard: a freeze at least this long discards the step without asking the lighthouse.
        bury: sets the current c10d group aside after a wait was cut short; ``None``: nothing is.
    """

    def __init__(self, lighthouse: str, me: str, quorum: Callable[[], Optional[Tuple[int, Sequence[str]]]], *,
                 poll: timedelta = timedelta(milliseconds=100),
                 fetch: Optional[Callable[[], LighthouseStatus]] = None,
                 freeze: Optional[FreezeClock] = None,
                 freeze_discard: timedelta = timedelta(seconds=1),
                 bury: Optional[Callable[[], None]] = None) -> None:
        if poll <= timedelta(0):
            raise ValueError(f"poll={poll} must be positive (FTBRIDGE_PEER_WATCH_POLL_MS)")
        self.me = me
        self._quorum = quorum
        self._poll = poll.total_seconds()
        self.poll_s = self._poll
        """Seconds between looks at the lighthouse."""
        limit = timedelta(seconds=min(1.0, 4 * self._poll))
        self._fetch = fetch or (lambda: fetch_status_bounded(lighthouse, limit))
        self._freeze = freeze or FreezeClock()
        self._freeze.start()
        self._freeze_discard = freeze_discard.total_seconds()
        self._bury = bury
        self._rebuild = False
        self._abandoned = False  # a wait of this step was cut short: cut the step's other waits at once
        self._doomed: Optional[Tuple[int, Tuple[str, ...]]] = None  # (quorum id, lost members) seen by the vote
        self._failed_reads = 0
        # a look() running in a helper thread, and when it started (time.monotonic())
        self._pending: Optional[Tuple[float, concurrent.futures.Future]] = None
        self.lost = 0
        """Waits cut short because a peer was lost (each discarded a step)."""
        self.last_lost: Tuple[str, ...] = ()

    # -- the survivor's side ------------------------------------------------
    def look(self, remember: bool = False) -> Tuple[str, ...]:
        """Read the lighthouse once: the members of this step's quorum it holds dead (empty: none, or no answer).

        Never raises. With ``remember``, a non-empty answer makes this quorum's later waits end at once.
        """
        seen = self._quorum()
        if seen is None:
            return ()
        try:
            status = self._fetch()
        except Exception as exc:  # noqa: BLE001 - the lighthouse is down or odd: fall back to the timeout
            self._failed_reads += 1
            if self._failed_reads == 1:
                logger.warning("peer watch: cannot read the lighthouse status (%s: %s); a hung peer costs "
                               "the cross-replica timeout until it answers", type(exc).__name__, exc)
            return ()
        self._failed_reads = 0
        lost = lost_members(seen[1], self.me, stale_ids(status))
        if lost and remember:
            self._doomed = (seen[0], lost)
        return lost

    def _look_nowait(self, since: float) -> Tuple[str, ...]:
        """The last finished :meth:`look` started at or after ``since``, and start the next; never blocks."""
        if self._pending is not None:
            started, pending = self._pending
            if not pending.done():
                return ()
            self._pending = None
            if started >= since:
                return pending.result()
        self._pending = (time.monotonic(), in_thread(self.look, "ftbridge-peer-watch-look"))  # look() never raises
        return ()

    def wait(self, work: Any) -> Tuple[str, ...]:
        """Block until the c10d ``work`` completes (``()``) or the lighthouse holds a member dead (the lost ids;
        :meth:`take_rebuild` then returns ``True`` once)."""
        since = time.monotonic()
        done = threading.Event()
        work.get_future().add_done_callback(lambda _fut: done.set())
        if self._abandoned and not done.is_set():  # same step, same buried process group: no wait
            return self.last_lost
        seen, doomed = self._quorum(), self._doomed
        # The vote of this quorum already found a member dead: no first poll.
        lost = doomed[1] if doomed is not None and seen is not None and seen[0] == doomed[0] else ()
        while not lost:
            if done.wait(self._poll):
                return ()
            lost = self._look_nowait(since)
        if done.is_set():  # finished while the lighthouse was read: its own wait() tells how
            return ()
        self.lost += 1
        self.last_lost = lost
        self._rebuild = self._abandoned = True
        self._doomed = None
        return lost

    def take_rebuild(self) -> bool:
        """Whether a wait was cut short since the last call: the next quorum must rebuild the process group."""
        rebuild, self._rebuild = self._rebuild, False
        if rebuild:
            self._abandoned = False  # called by the next quorum: its waits run on a new process group
        return rebuild

    def allreduce(self, manager: Any, tensor: torch.Tensor, reduce_op: Any, private: bool = False) -> "WatchedWork":
        """torchft's ``manager.allreduce`` (``AVG`` or ``SUM``) of float ``tensor`` under this watch; in place when
        ``private`` (lent, :meth:`ftbridge.manager.ReplicaManager.lend`), else on a copy."""
        buf = tensor if private else tensor.clone()
        return WatchedWork(manager.allreduce(buf, reduce_op=reduce_op), buf, tensor, self,
                           lambda error: self._on_lost(manager, error))

    def _on_lost(self, manager: Any, error: Exception) -> None:
        logger.warning("[%s] %s", self.me, error)
        manager.report_error(error)
        if self._bury is not None:
            self._bury()

    # -- the resumed side ---------------------------------------------------
    def dropped_while_frozen(self, step_start: float) -> bool:
        """Whether this step (started at ``step_start``, monotonic s) must be discarded: a freeze of at least
        ``freeze_discard`` during it, or one longer than ``poll`` after which the lighthouse issued a later quorum
        without this group."""
        frozen = self._freeze.frozen_since(step_start)
        if frozen <= self._poll:
            return False
        if frozen >= self._freeze_discard:
            # The survivors may have cut this group off and discarded, before the lighthouse issues the
            # quorum without it that the check below looks for: only a discard is safe (behind, it heals).
            logger.warning("peer watch: frozen %.1f s during this step (>= %.1f s): discarding it", frozen,
                           self._freeze_discard)
            return True
        seen = self._quorum()
        try:
            status = self._fetch() if seen is not None else None
        except Exception as exc:  # noqa: BLE001 - no answer: commit as torchft would
            logger.warning("peer watch: frozen during this step, but the lighthouse did not answer (%s)", exc)
            return False
        if seen is None or status is None:
            return False
        return dropped_from_quorum(seen[0], self.me, status.quorum_id, [m.replica_id for m in status.members])

    def check_commit(self, manager: Any, step_start: float) -> None:
        """Before ``should_commit``: record an error with ``manager`` if :meth:`dropped_while_frozen`."""
        if self.dropped_while_frozen(step_start):
            manager.report_error(RuntimeError(
                "this process was frozen during the step and the lighthouse has since left its replica group "
                "out of the quorum: step discarded (the others went on without it; it heals when it rejoins)"))

    def close(self) -> None:
        """Stop the freeze detector's thread."""
        self._freeze.stop()


def start_watch(cfg: Any, guard: Any, use_cuda: bool, process_group: Any = None) -> Optional[QuorumWatch]:
    """The rank's peer watch, or ``None`` when off, on NCCL (``use_cuda``) or without the quorum ``guard``."""
    if not cfg.peer_watch or use_cuda or guard is None:
        if cfg.peer_watch:
            logger.info("peer watch off (%s): a hung peer costs the cross-replica timeout",
                        "NCCL process group" if use_cuda else "quorum guard not installed")
        return None

    def quorum() -> Optional[Tuple[int, Sequence[str]]]:
        seen = guard.seen
        return None if seen is None else (seen.quorum_id, seen.members)

    watch = QuorumWatch(cfg.lighthouse, f"replica_group_{cfg.replica_group_id}", quorum, poll=cfg.peer_watch_poll,
                        freeze_discard=cfg.peer_watch_freeze_discard, bury=getattr(process_group, "bury", None))
    guard.watch = watch
    return watch


def wait_for_keys(store: Any, keys: List[str], timeout: timedelta, watch: Optional[QuorumWatch]) -> None:
    """``store.wait(keys, timeout)`` in slices of the watch's poll, ended early once a quorum member is dead.

    Raises:
        PeerLost: the lighthouse holds a member of this quorum dead.
        DistStoreError: ``timeout`` passed, or the store failed.
    """
    if watch is None:
        store.wait(keys, timeout)
        return
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        left = deadline - time.monotonic()
        try:
            store.wait(keys, timedelta(seconds=max(0.001, min(watch.poll_s, left))))
            return
        except DistStoreError as exc:
            if "timeout" not in str(exc).lower() or time.monotonic() >= deadline:
                raise
        lost = watch.look(remember=True)
        if lost:
            raise PeerLost(f"the lighthouse holds {', '.join(lost)} dead: not waiting for its vote")


class WatchedWork:
    """A cross-replica all-reduce of ``buf`` (a copy of ``tensor``, or ``tensor`` itself when lent) by torchft's
    ``work``, waited on under ``watch``; ``on_lost`` gets the :class:`PeerLost` of a wait cut short."""

    def __init__(self, work: Any, buf: torch.Tensor, tensor: torch.Tensor, watch: QuorumWatch,
                 on_lost: Callable[[PeerLost], None]) -> None:
        self._work, self._buf, self._tensor = work, buf, tensor
        self._watch, self._on_lost = watch, on_lost

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        """Wait under the watch; ``False`` when the step is to be discarded (``tensor`` is then untouched if copied,
        undefined if lent)."""
        # torchft 0.2 _ManagedWork: the process group's own work (an internal; the watch runs only where
        # ftbridge.manager.torchft_api.internals_supported holds, see start_watch)
        raw = getattr(self._work, "_work", None)
        if raw is not None and hasattr(raw, "get_future"):
            lost = self._watch.wait(raw)
            if lost:
                self._on_lost(PeerLost(f"the lighthouse holds {', '.join(lost)} dead (no heartbeat for its "
                                       "heartbeat timeout): cross-replica all-reduce abandoned, step discarded"))
                return False
        ok = self._work.wait()
        if ok is not False and self._buf is not self._tensor:
            self._tensor.copy_(self._buf)
        return ok
