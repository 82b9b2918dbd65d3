"""The one door to torchft: every torchft name ftbridge and the lighthouse service use, and the version check.

No other module of ``ftbridge/``, ``lighthouse/`` or ``scripts/`` imports torchft
(``tests/test_boundaries.py``; docs/concepts.md, "Import graph"). torchft internals (:class:`DummyWork`,
``Manager._client``, ``_quorum_id``, ``_healing``, ``_pending_state_dict``, ``_min_replica_size``, ``_pg``, ``_store``,
``_manager``, the wrapper's ``_pg``, ``_ManagedWork._work``) are used only inside :mod:`ftbridge.manager`
and only where :func:`internals_supported` holds.
"""

from __future__ import annotations

import importlib.metadata
from datetime import timedelta
from typing import Any, Callable

from torchft import Manager
from torchft._torchft import ManagerServer
from torchft.checkpointing.transport import CheckpointTransport
from torchft.coordination import LighthouseServer
from torchft.manager import REPLICA_ID_KEY
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
    "pause_manager_server",
    "replica_id_of",
]

TORCHFT_GUARDED_VERSIONS = ("0.2.",)
"""torchft version prefixes whose ``Manager`` internals ftbridge was written against."""

_GUARDED_FIELDS = ("_client", "_quorum_id", "_async_quorum")


def installed_version() -> str:
    """The installed torchft's version string (``importlib.metadata``), e.g. ``"0.2.0"``."""
    return importlib.metadata.version("torchft")


def internals_supported(manager: Any) -> bool:
    """Whether ftbridge may use ``manager``'s private fields: the installed torchft is one of
    :data:`TORCHFT_GUARDED_VERSIONS` and ``manager`` (a :class:`Manager` or a stand-in) has the fields the quorum guard
    uses."""
    return (installed_version().startswith(TORCHFT_GUARDED_VERSIONS)
            and all(hasattr(manager, a) for a in _GUARDED_FIELDS))


def replica_id_of(manager: Any) -> str:
    """The replica id group rank 0's manager server gave the lighthouse (``replica_group_G:UUID``), read from the
    group's store (any rank).

    Raises:
        Whatever the store's ``get`` raises (the store is gone, or the key is not set within its timeout).
    """
    return manager._store.get(REPLICA_ID_KEY).decode("utf-8")


def pause_manager_server(manager: Any, *, lighthouse_addr: str, hostname: str, heartbeat_interval: timedelta,
                         connect_timeout: timedelta, quorum_retries: int) -> Callable[[], None]:
    """Shut down group rank 0's manager server (its heartbeats stop); return ``resume()``, which builds a new one on the
    same port with the same replica id and the given arguments. The group must not call torchft in between.

    Raises:
        AttributeError: ``manager`` holds no manager server (not group rank 0).
    """
    server = manager._manager
    if server is None:
        raise AttributeError("only group rank 0's torchft Manager holds a manager server")
    port = int(server.address().rsplit(":", 1)[1])
    replica_id = replica_id_of(manager)
    store_addr = f"{manager._store.host}:{manager._store.port}"
    world_size = manager._group_world_size
    server.shutdown()

    def resume() -> None:
        manager._manager = ManagerServer(
            replica_id=replica_id, lighthouse_addr=lighthouse_addr, hostname=hostname, bind=f"[::]:{port}",
            store_addr=store_addr, world_size=world_size, heartbeat_interval=heartbeat_interval,
            connect_timeout=connect_timeout, quorum_retries=quorum_retries)

    return resume
