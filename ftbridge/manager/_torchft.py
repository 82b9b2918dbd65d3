"""The one door to torchft: every torchft name ftbridge and the lighthouse service use, and the version check.

No other module of ``ftbridge/``, ``lighthouse/`` or ``scripts/`` imports torchft
(``tests/test_boundaries.py`` checks it; the import graph is in ``docs/concepts.md``).
Upgrading torchft starts here: the names below are what ftbridge builds on, and
:func:`internals_supported` is what decides whether the code that reads torchft's
private fields runs at all.

Public torchft API:

* :class:`Manager` (:class:`ftbridge.manager.ReplicaManager` composes it);
* :class:`ProcessGroupGloo`, :class:`ProcessGroupNCCL`, :func:`create_store_client`
  (:mod:`ftbridge.manager.store_probe` subclasses the groups; the quorum guard's vote
  and the store probe connect to the primary's TCPStore);
* :class:`CheckpointTransport` (the base of :class:`ftbridge.manager.transport.SafeHTTPTransport`);
* :class:`LighthouseServer` (``torchft.coordination``'s native lighthouse, started by
  :func:`lighthouse.server.start_lighthouse`).

torchft internals, read or written only inside :mod:`ftbridge.manager` and only when
:func:`internals_supported` holds (the quorum guard, the heal agreement, the peer watch
and the outage rider are built only then):

* :class:`DummyWork` (``torchft.work._DummyWork``), the placeholder work after an error;
* ``Manager._client``, ``_quorum_id``, ``_healing``, ``_pending_state_dict``, ``_pg``,
  ``_store``; the process group wrapper's ``_pg``; ``_ManagedWork._work``.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from torchft import Manager
from torchft.checkpointing.transport import CheckpointTransport
from torchft.coordination import LighthouseServer
from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL, create_store_client
from torchft.work import _DummyWork as DummyWork

__all__ = [
    "TORCHFT_GUARDED_VERSIONS",
    "CheckpointTransport",
    "DummyWork",
    "LighthouseServer",
    "Manager",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "create_store_client",
    "installed_version",
    "internals_supported",
]

TORCHFT_GUARDED_VERSIONS = ("0.2.",)
"""torchft versions whose ``Manager`` internals the quorum guard (and what hangs on it) was written against."""

_GUARDED_FIELDS = ("_client", "_quorum_id", "_async_quorum")
"""``Manager`` fields whose presence :func:`internals_supported` checks besides the version."""


def installed_version() -> str:
    """The installed torchft's version string (``importlib.metadata``), e.g. ``"0.2.0"``."""
    return importlib.metadata.version("torchft")


def internals_supported(manager: Any) -> bool:
    """Whether ftbridge may read and write ``manager``'s private fields.

    Args:
        manager: a :class:`Manager` (or a stand-in with the same fields).

    Returns:
        ``True`` when the installed torchft is one of :data:`TORCHFT_GUARDED_VERSIONS` and
        ``manager`` has the fields the quorum guard replaces or reads.
    """
    return (installed_version().startswith(TORCHFT_GUARDED_VERSIONS)
            and all(hasattr(manager, a) for a in _GUARDED_FIELDS))
