"""Bounded calls to a TCPStore that may be hung, and a bounded gloo rendezvous.

:func:`probe_store` makes one request with a deadline; :class:`ProbedProcessGroupGloo` and
:class:`ProbedProcessGroupNCCL` probe the quorum's store before torchft's ``configure`` dials it (a hung
primary fails that step instead of blocking), the gloo one bounds its rendezvous from ``configure``'s entry
(:func:`rendezvous_wait_s`), and both can set a group with a pending operation aside (``bury``). Why:
docs/design.md, "The quorum guard" and "The peer watch".
"""

from __future__ import annotations

import concurrent.futures
import time
from datetime import timedelta
from typing import Any, List, Optional, Tuple

from ftbridge.manager.futures import call_bounded, in_thread
from ftbridge.manager.torchft_api import (
    TORCHFT_GUARDED_VERSIONS,
    ProcessGroupGloo,
    ProcessGroupNCCL,
    create_store_client,
    installed_version,
)

CONNECT_ATTEMPT_S = 1.0
"""A probe's connection attempt not done after this long is abandoned and another one started."""

CONNECT_ATTEMPTS = 3
"""Connection attempts of a probe before its timeout; the last one gets what is left of the timeout."""

RENDEZVOUS_BOUND = 2
"""A ``configure`` (probe, store connection and gloo's rendezvous) may take at most this many times the group's
timeout, counted from its entry."""

LATE_ENTRY = 0.9
"""A rank that reaches gloo's rendezvous this fraction of the timeout or more after it entered ``configure`` gives
up at once: its peers left the reconfigure vote with it and wait for its address for one timeout only."""


def rendezvous_wait_s(entered: float, now: float, timeout_s: float) -> Optional[float]:
    """How long gloo's rendezvous may take, seconds, for a rank that entered ``configure`` at ``entered``.

    Args:
        entered: ``time.monotonic()`` at ``configure``'s entry, seconds.
        now: ``time.monotonic()`` as the rendezvous starts, seconds.
        timeout_s: the group's timeout, seconds (> 0).

    Returns:
        ``None`` when ``now - entered`` is at least :data:`LATE_ENTRY` times the timeout (the rank is too late:
        the members that reached the rendezvous on time stop waiting for it at about one timeout); else what is
        left of :data:`RENDEZVOUS_BOUND` times the timeout from ``entered``.
    """
    elapsed = max(0.0, now - entered)
    if elapsed >= LATE_ENTRY * timeout_s:
        return None
    return RENDEZVOUS_BOUND * timeout_s - elapsed


def connect_store(store_addr: str, timeout: timedelta) -> Any:
    """A client of the TCPStore at ``store_addr`` (``host:port[/prefix]``; torchft's ``create_store_client``: a
    ``PrefixStore`` over a ``TCPStore`` whose requests wait up to ``timeout``).

    Up to :data:`CONNECT_ATTEMPTS` attempts, each abandoned after :data:`CONNECT_ATTEMPT_S` (the last one after
    what is left of ``timeout``): a c10d connection to a live store can stall for seconds whatever its timeout
    while the next one connects at once (docs/design.md, "Hung stores"). An abandoned attempt runs on in its
    thread until c10d gives up; its client is dropped.

    Raises:
        TimeoutError: no attempt connected within ``timeout``.
        DistError: the store refused the connection until an attempt's own timeout.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    for tries in range(1, CONNECT_ATTEMPTS + 1):
        attempt = in_thread(lambda: create_store_client(store_addr, timeout=timeout), "ftbridge-store-connect")
        left = deadline - time.monotonic()
        wait_s = left if tries == CONNECT_ATTEMPTS else min(CONNECT_ATTEMPT_S, left)
        done, _ = concurrent.futures.wait([attempt], timeout=max(0.0, wait_s))
        if done:
            return attempt.result()
        if time.monotonic() >= deadline:
            break
    raise TimeoutError(f"the quorum's store {store_addr.split('/', 1)[0]} did not accept a connection within "
                       f"{timeout.total_seconds():g} s ({tries} attempt{'s' if tries > 1 else ''}; its host hung?)")


def probe_store(store_addr: str, timeout: timedelta) -> Any:
    """Open a client of the TCPStore at ``store_addr`` (``host:port[/prefix]``, :func:`connect_store`) and check that
    the store answers one request.

    Returns:
        The client, for the caller to use (a ``PrefixStore``; requests wait up to ``timeout``).

    Raises:
        TimeoutError: no connection, or no answer, within ``timeout`` in all.
        DistError: the store refused or closed the connection.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    store = connect_store(store_addr, timeout)
    left = timedelta(seconds=max(0.1, deadline - time.monotonic()))
    call_bounded(lambda: store.check(["ftbridge/probe"]), left, f"the quorum's store {store_addr.split('/', 1)[0]}")
    return store


class _Probed:
    """Mixin: probe the quorum's store before torchft's ``configure`` dials it; :meth:`bury` a hung group."""

    _timeout: timedelta
    _pg: Any  # torchft's ProcessGroupWrapper: the c10d process group of the current quorum
    _configure_phases: Optional[List[Tuple[str, float]]] = None  # (part, its end) of the configure under way

    def bury(self) -> None:
        """Set the current c10d process group aside with its operations pending; the next ``configure`` builds a new
        one.

        Groups set aside are released once older than twice the timeout. Until then collectives on this group fail.
        """
        now = time.monotonic()
        graves = getattr(self, "_graves", [])
        self._graves = [(t, pg) for t, pg in graves if now - t < 2 * self._timeout.total_seconds()]
        if self._pg is not None:
            self._graves.append((now, self._pg))
            self._pg = None

    def configure(self, store_addr: str, *args: Any, **kwargs: Any) -> None:
        """Probe the quorum's store (:meth:`_probe`), then torchft's ``configure``.

        Raises:
            TimeoutError: the store did not answer in time (:func:`probe_store`); the group is left closed.
        """
        try:
            self._probe(store_addr)
            super().configure(store_addr, *args, **kwargs)  # type: ignore[misc]
        finally:
            self._configure_phases = None

    def _probe(self, store_addr: str) -> Any:
        """A ``configure``'s first part: note its entry (for the rendezvous bound and the phases) and probe the store.

        Returns:
            The probe's store client (:func:`probe_store`).

        Raises:
            Whatever :func:`probe_store` raises, after closing the current group (no stale group with the old
            members survives a failed ``configure``) and noting the store unreachable (:meth:`take_store_unreachable`).
        """
        self._configure_entered = time.monotonic()
        self._configure_phases = [("entry", self._configure_entered)]
        try:
            store = probe_store(store_addr, self._timeout)
        except Exception:
            self._store_unreachable = True
            self.abort(errored=False)
            raise
        self._phase("opening and probing the store")
        return store

    def abort(self, errored: bool = True) -> None:
        """torchft's ``abort`` (the current group is closed; torchft's next ``configure`` builds another)."""
        super().abort(errored)  # type: ignore[misc]
        self._phase("closing the previous group")

    def _phase(self, what: str) -> None:
        """Inside ``configure``: record that ``what`` ended now (for :meth:`_phases_text`)."""
        if self._configure_phases is not None:
            self._configure_phases.append((what, time.monotonic()))

    def _phases_text(self) -> str:
        """How long each recorded part of the current ``configure`` took, e.g.
        ``"opening and probing the store 0.00 s, closing the previous group 0.00 s"``."""
        phases = self._configure_phases or []
        return ", ".join(f"{what} {t - prev:.2f} s" for (_, prev), (what, t) in zip(phases, phases[1:]))

    def take_store_unreachable(self) -> bool:
        """Whether a ``configure`` since the last call found the quorum's store unanswering (then cleared); call after
        ``Manager.wait_quorum``."""
        unreachable = getattr(self, "_store_unreachable", False)
        self._store_unreachable = False
        return unreachable


class ProbedProcessGroupGloo(_Probed, ProcessGroupGloo):
    """torchft's ``ProcessGroupGloo`` whose ``configure`` fails within its timeout on a hung store, at once when it
    reaches the rendezvous too late for its peers, and within :data:`RENDEZVOUS_BOUND` times the timeout from its
    entry when a peer it must connect to is gone."""

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int, quorum_id: Optional[int] = None,
                  group_rank: Optional[int] = None, group_world_size: Optional[int] = None,
                  global_ranks: Optional[List[int]] = None) -> None:
        """torchft's ``ProcessGroupWrapper.configure`` (torchft 0.2) on the store connection the probe opened: a
        reconfigure opens one store connection, not two (why: docs/design.md, "Hung stores"). Another torchft
        release gets the probe and then torchft's own ``configure``.

        Raises:
            TimeoutError: the store did not answer in time (:func:`probe_store`), or the rendezvous failed its
                bound (:meth:`_create_pg`); the group is left closed.
        """
        if not installed_version().startswith(TORCHFT_GUARDED_VERSIONS):
            super().configure(store_addr, replica_id, rank, world_size, quorum_id, group_rank, group_world_size,
                              global_ranks)
            return
        try:
            store = self._probe(store_addr)
            self._replica_id, self._quorum_id, self._rank = replica_id, quorum_id, rank
            self._group_rank, self._group_world_size, self._global_ranks = group_rank, group_world_size, global_ranks
            self.abort(errored=False)
            self._pg = self._create_pg(store, rank, world_size)
        finally:
            self._configure_phases = None

    def _create_pg(self, store: Any, rank: int, world_size: int) -> Any:
        """Gloo's rendezvous (torchft's ``_create_pg``), bounded by :func:`rendezvous_wait_s`.

        Raises:
            TimeoutError: the rank reached the rendezvous :data:`LATE_ENTRY` times the timeout or more after it
                entered ``configure`` (no rendezvous is tried), or the rendezvous was not done within what is left
                of the bound (a group the abandoned thread builds later is dropped).
            RuntimeError: gloo's own failure within the bound.
        """
        timeout_s = self._timeout.total_seconds()
        now = time.monotonic()
        entered = getattr(self, "_configure_entered", now)
        bound_s = rendezvous_wait_s(entered, now, timeout_s)
        if bound_s is None:
            raise TimeoutError(
                f"the cross-replica process group (rank {rank} of {world_size}): this rank reached the rendezvous "
                f"{now - entered:.2f} s after entering configure ({self._phases_text()}), and its peers wait for it "
                f"{timeout_s:g} s (cross_replica_timeout) from about then; step discarded, the next quorum builds "
                "afresh")
        build = in_thread(lambda: super(ProbedProcessGroupGloo, self)._create_pg(store, rank, world_size),
                          "ftbridge-gloo-rendezvous")
        done, _ = concurrent.futures.wait([build], timeout=bound_s)
        if not done:
            raise TimeoutError(
                f"the cross-replica process group (rank {rank} of {world_size}) did not connect within "
                f"{RENDEZVOUS_BOUND * timeout_s:g} s of entering configure ({RENDEZVOUS_BOUND} x "
                "cross_replica_timeout): a member that published its address is gone or unreachable; step "
                "discarded, the next quorum builds afresh")
        return build.result()


class ProbedProcessGroupNCCL(_Probed, ProcessGroupNCCL):
    """torchft's ``ProcessGroupNCCL`` whose ``configure`` fails within its timeout on a hung store."""

