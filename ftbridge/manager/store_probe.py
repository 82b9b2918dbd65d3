"""Bounded calls to a TCPStore that may be hung, and a bounded gloo rendezvous.

:func:`probe_store` makes one request with a deadline; :class:`ProbedProcessGroupGloo` and
:class:`ProbedProcessGroupNCCL` probe the quorum's store before torchft's ``configure`` dials it (a hung
primary fails that step instead of blocking), the gloo one bounds its rendezvous, and both can set a group
with a pending operation aside (``bury``). Why: docs/design.md, "The quorum guard" and "The peer watch".
"""

from __future__ import annotations

import concurrent.futures
import time
from datetime import timedelta
from typing import Any, Callable

from ftbridge.manager.futures import call_bounded, in_thread
from ftbridge.manager.torchft_api import ProcessGroupGloo, ProcessGroupNCCL, create_store_client

RENDEZVOUS_BOUND = 2
"""A gloo rendezvous may take at most this many times the group's timeout."""


def probe_store(store_addr: str, timeout: timedelta) -> None:
    """Check that the TCPStore at ``store_addr`` (``host:port[/prefix]``) answers one request.

    Raises:
        TimeoutError: no answer within ``timeout`` (connect, then one ``check``).
        DistError: the store refused or closed the connection.
    """
    def ask() -> None:
        create_store_client(store_addr, timeout=timeout).check(["ftbridge/probe"])

    call_bounded(ask, timeout, f"the quorum's store {store_addr.split('/', 1)[0]}")


class _Probed:
    """Mixin: probe the quorum's store before torchft's ``configure`` dials it; :meth:`bury` a hung group."""

    _timeout: timedelta
    _pg: Any  # torchft's ProcessGroupWrapper: the c10d process group of the current quorum
    abort: Callable[..., None]  # torchft's ProcessGroup method, found next in the MRO

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
        try:
            probe_store(store_addr, self._timeout)
        except Exception:
            self._store_unreachable = True
            self.abort(errored=False)  # no stale group with the old members survives a failed configure
            raise
        super().configure(store_addr, *args, **kwargs)  # type: ignore[misc]

    def take_store_unreachable(self) -> bool:
        """Whether a ``configure`` since the last call found the quorum's store unanswering (then cleared); call after
        ``Manager.wait_quorum``."""
        unreachable = getattr(self, "_store_unreachable", False)
        self._store_unreachable = False
        return unreachable


class ProbedProcessGroupGloo(_Probed, ProcessGroupGloo):
    """torchft's ``ProcessGroupGloo`` whose ``configure`` fails within its timeout on a hung store, and within
    :data:`RENDEZVOUS_BOUND` times it when a peer it must connect to is gone."""

    def _create_pg(self, store: Any, rank: int, world_size: int) -> Any:
        """Gloo's rendezvous (torchft's ``_create_pg``), bounded by :data:`RENDEZVOUS_BOUND` times the timeout.

        Raises:
            TimeoutError: not done within the bound; a group the abandoned thread builds later is dropped.
            RuntimeError: gloo's own failure within the bound.
        """
        bound = self._timeout * RENDEZVOUS_BOUND
        build = in_thread(lambda: super(ProbedProcessGroupGloo, self)._create_pg(store, rank, world_size),
                          "ftbridge-gloo-rendezvous")
        done, _ = concurrent.futures.wait([build], timeout=bound.total_seconds())
        if not done:
            raise TimeoutError(
                f"the cross-replica process group (rank {rank} of {world_size}) did not connect within "
                f"{bound.total_seconds():g} s ({RENDEZVOUS_BOUND} x cross_replica_timeout): a member that "
                "published its address is gone or unreachable; step discarded, the next quorum builds afresh")
        return build.result()


class ProbedProcessGroupNCCL(_Probed, ProcessGroupNCCL):
    """torchft's ``ProcessGroupNCCL`` whose ``configure`` fails within its timeout on a hung store."""

