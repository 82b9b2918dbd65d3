"""Bounded calls to a TCPStore that may be hung.

The cross-replica process group of a quorum rendezvouses on the primary
group's store (torchft's ``store_address``), which lives in that group's
rank 0. When that rank hangs (SIGSTOP, a stuck host), its kernel still accepts
TCP connections but nothing answers, and c10d's TCPStore client then blocks
with no timeout: connecting (the validation handshake) and ``delete_key``
block for as long as the hang, whatever timeout the client was given. Any
such call made from torchft's quorum thread stalls the whole group; its
``should_commit`` then expires and the group dies.

:func:`probe_store` makes one request with a deadline
(:func:`ftbridge.manager.futures.call_bounded`), and
:class:`ProbedProcessGroupGloo` / :class:`ProbedProcessGroupNCCL` check that
the store answers before torchft's ``configure`` dials it, so a quorum whose
primary just hung fails that step (torchft records the error and the step is
discarded on every replica) instead of blocking until the hang ends.

Gloo's rendezvous is bounded too (:class:`ProbedProcessGroupGloo`): when a
member published its address and then died, gloo's ``connectFullMesh`` keeps
connecting to it for five times the group's timeout (25 s for the default 5 s
cross-replica timeout), whatever that timeout says, and the member's quorum
thread with it. :data:`RENDEZVOUS_BOUND` times the timeout is the most a
rendezvous may take here (gloo's wait for the peers' addresses, then one
connect window); past it ``configure`` raises, the step is discarded, and the
group built late in the abandoned thread is dropped, never installed.
"""

from __future__ import annotations

import concurrent.futures
import time
from datetime import timedelta
from typing import Any, Callable

from ftbridge.manager.futures import call_bounded, in_thread
from ftbridge.manager.torchft_api import ProcessGroupGloo, ProcessGroupNCCL, create_store_client

RENDEZVOUS_BOUND = 2
"""A gloo rendezvous may take at most this many times the group's timeout (:class:`ProbedProcessGroupGloo`)."""


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
        """Set the current c10d process group aside, with its operations still pending
        (:mod:`ftbridge.manager.quorum_watch`).

        Gloo cannot cancel an operation, and aborting or dropping the group
        waited for the pending one to time out; kept here, the group is
        released once every group set aside earlier is older than twice the
        timeout (its operations have timed out by then). The next
        ``configure`` builds a new group; until then collectives on this one fail.
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
        """Whether a ``configure`` since the last call found the quorum's store unanswering (then cleared).

        Read on the training thread after the quorum (``Manager.wait_quorum``): the step's ``configure``, run in
        torchft's quorum thread, has finished by then.
        """
        unreachable = getattr(self, "_store_unreachable", False)
        self._store_unreachable = False
        return unreachable


class ProbedProcessGroupGloo(_Probed, ProcessGroupGloo):
    """torchft's ``ProcessGroupGloo`` whose ``configure`` fails within its timeout on a hung store, and within
    :data:`RENDEZVOUS_BOUND` times it when a peer it must connect to is gone."""

    def _create_pg(self, store: Any, rank: int, world_size: int) -> Any:
        """Gloo's rendezvous (torchft's ``_create_pg``), bounded by ``RENDEZVOUS_BOUND x`` the timeout.

        Raises:
            TimeoutError: the rendezvous did not end within the bound. It keeps running in its daemon
                thread until gloo gives up; a group it builds then is dropped (``self._pg`` stays ``None``,
                as ``configure`` left it), so the next ``configure`` starts afresh.
            RuntimeError: gloo's own failure within the bound (a peer's address never came).
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

