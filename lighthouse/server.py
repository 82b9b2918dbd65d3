"""Run torchft's lighthouse in-process, with ftbridge's defaults and checks.

The server is torchft's own Rust ``LighthouseServer`` (via :mod:`ftbridge.manager.torchft_api`); this
module validates the arguments, sets defaults for fast failover, fixes the reported address and warns
when it binds beyond loopback. One port serves gRPC and HTTP, unauthenticated; state is in memory only.
Quorum timing and the 1000 ms join timeout: ``docs/lighthouse.md``, "Quorum timing".

Example::

    with start_lighthouse(min_replicas=2) as lh:
        os.environ["TORCHFT_LIGHTHOUSE"] = lh.address   # http://127.0.0.1:PORT
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import time
from dataclasses import dataclass
from typing import Optional

from ftbridge.device import is_loopback

logger = logging.getLogger("lighthouse")

DEFAULT_BIND = "127.0.0.1:29510"
"""Loopback on torchft's usual port: reachable only from this machine."""

DEFAULT_MIN_REPLICAS = 1
"""Fewest replica groups in a quorum."""

DEFAULT_JOIN_TIMEOUT_MS = 1000
"""How long a quorum waits for heartbeating groups that have not joined yet (ms); torchft's is 60000."""

DEFAULT_HEARTBEAT_TIMEOUT_MS = 3000
"""A group silent for this long is considered dead (ms); torchft's is 5000, which with two groups makes the
survivors' quorum form just as the first try of their call ends (the ``departure-wait`` check)."""

DEFAULT_QUORUM_TICK_MS = 100
"""How often the lighthouse re-checks whether a quorum can form (ms)."""

_WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def parse_bind(bind: str) -> tuple[str, int]:
    """``(host, port)`` from ``HOST:PORT`` or ``[IPV6]:PORT`` (brackets removed); port 0 means a free port.

    Raises ValueError for anything else, an empty host, or a port outside 0-65535.
    """
    if not isinstance(bind, str) or ":" not in bind:
        raise ValueError(
            f"bind={bind!r} is not HOST:PORT; use e.g. 127.0.0.1:29510, or 127.0.0.1:0 for a free port"
        )
    if bind.startswith("["):
        close = bind.find("]")
        if close < 0 or bind[close + 1:close + 2] != ":":
            raise ValueError(f"bind={bind!r} is not [IPV6]:PORT; use e.g. [::1]:29510")
        host, port_text = bind[1:close], bind[close + 2:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"bind={bind!r}: {host!r} inside [] is not an IPv6 address") from None
    else:
        host, _, port_text = bind.rpartition(":")
        if ":" in host:
            raise ValueError(f"bind={bind!r} looks like a bare IPv6 address; write it as [ADDR]:PORT")
    if not host:
        raise ValueError(f"bind={bind!r} has no host; use 127.0.0.1 (this machine only) or 0.0.0.0 (all interfaces)")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"bind={bind!r} has port {port_text!r}; use a number in 0-65535 (0 picks a free port)")
    return host, int(port_text)


def _accepts_connections(host: str, port: int) -> bool:
    """True while something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _check_positive_ms(name: str, value: Optional[int]) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive whole number of milliseconds")


@dataclass(frozen=True)
class LighthouseSettings:
    """Validated arguments of one lighthouse; see :func:`start_lighthouse`."""

    bind: str
    min_replicas: int
    join_timeout_ms: int
    heartbeat_timeout_ms: int
    quorum_tick_ms: int

    def validate(self) -> tuple[str, int]:
        """Check every value (ValueError naming it and the fix); return ``bind``'s ``(host, port)``."""
        host, port = parse_bind(self.bind)
        if isinstance(self.min_replicas, bool) or not isinstance(self.min_replicas, int) or self.min_replicas < 1:
            raise ValueError(f"min_replicas={self.min_replicas!r} must be a whole number >= 1")
        _check_positive_ms("join_timeout_ms", self.join_timeout_ms)
        _check_positive_ms("heartbeat_timeout_ms", self.heartbeat_timeout_ms)
        _check_positive_ms("quorum_tick_ms", self.quorum_tick_ms)
        if self.quorum_tick_ms >= self.heartbeat_timeout_ms:
            raise ValueError(
                f"quorum_tick_ms={self.quorum_tick_ms} is not below heartbeat_timeout_ms="
                f"{self.heartbeat_timeout_ms}: dead groups would be noticed a tick late; "
                "lower quorum_tick_ms (100 is usual)"
            )
        return host, port


class LighthouseService:
    """A running torchft lighthouse; stop it with :meth:`shutdown` or ``with``.

    Attributes:
        address: ``http://HOST:PORT`` for clients (``TORCHFT_LIGHTHOUSE``): the bound host, or for a
            wildcard bind (``0.0.0.0``, ``::``) the hostname torchft reports.
        port: the bound TCP port (the free port chosen when 0 was asked).
        settings: the validated settings it runs with.
    """

    def __init__(self, server: Optional[object], address: str, port: int, settings: LighthouseSettings,
                 connect_host: str) -> None:
        self._server = server
        self._connect_host = connect_host
        self.address = address
        self.port = port
        self.settings = settings

    @property
    def local_address(self) -> str:
        """``http://HOST:PORT`` that reaches it from this machine (loopback for a wildcard bind)."""
        host = self._connect_host
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop serving and wait up to ``timeout_s`` until the port refuses connections (then log a WARNING and
        return). Idempotent. Why it also drops torchft's object: ``docs/lighthouse.md``, "Implementation notes".
        """
        if self._server is None:
            return
        self._server.shutdown()  # type: ignore[attr-defined]
        self._server = None  # the last reference: torchft's Drop closes the listener
        deadline = time.monotonic() + timeout_s
        while _accepts_connections(self._connect_host, self.port):
            if time.monotonic() > deadline:
                logger.warning("still listening after shutdown address=%s waited_s=%.1f", self.address, timeout_s)
                return
            time.sleep(0.01)
        logger.info("stopped address=%s", self.address)

    def __enter__(self) -> "LighthouseService":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "stopped" if self._server is None else "serving"
        return f"LighthouseService({state} on {self.address}, min_replicas={self.settings.min_replicas})"


def _warn_exposed(bind: str) -> None:
    logger.warning(
        "exposed bind=%s: the lighthouse and the managers' gRPC/HTTP endpoints have NO "
        "authentication (anyone who reaches them can, e.g., POST /replica/{id}/kill to stop a "
        "replica group, or join quorums); keep them on a private network or firewall the ports",
        bind,
    )


def start_lighthouse(
    bind: str = DEFAULT_BIND,
    min_replicas: int = DEFAULT_MIN_REPLICAS,
    *,
    join_timeout_ms: int = DEFAULT_JOIN_TIMEOUT_MS,
    heartbeat_timeout_ms: int = DEFAULT_HEARTBEAT_TIMEOUT_MS,
    quorum_tick_ms: int = DEFAULT_QUORUM_TICK_MS,
) -> LighthouseService:
    """Validate the arguments, then start torchft's lighthouse in this process; returns once it listens.

    Args:
        bind: ``HOST:PORT`` to listen on; port 0 picks a free port. Anything but loopback logs a WARNING
            (no authentication).
        min_replicas: fewest replica groups that form a quorum (>= 1).
        join_timeout_ms: how long a quorum waits for heartbeating groups not yet joined (ms, > 0).
        heartbeat_timeout_ms: silence after which a group is dead (ms, > 0).
        quorum_tick_ms: how often a pending quorum is re-checked (ms, > 0, below ``heartbeat_timeout_ms``).

    Returns:
        A running :class:`LighthouseService`.

    Raises:
        ValueError: a bad argument (before anything is started).
        OSError: the address is taken or cannot be bound (torchft's error as the cause).
    """
    settings = LighthouseSettings(
        bind=bind,
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
        quorum_tick_ms=quorum_tick_ms,
    )
    host, _ = settings.validate()
    if not is_loopback(host):
        _warn_exposed(bind)

    # torchft's native lighthouse through its one door (ftbridge.manager.torchft_api); heavy, only when starting
    from ftbridge.manager.torchft_api import LighthouseServer

    try:
        server = LighthouseServer(
            bind=bind,
            min_replicas=min_replicas,
            join_timeout_ms=join_timeout_ms,
            quorum_tick_ms=quorum_tick_ms,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
        )
    except Exception as exc:  # torchft raises RuntimeError with the OS message
        raise OSError(f"cannot start the lighthouse on bind={bind!r}: {exc}") from exc

    reported = server.address()  # e.g. http://HOSTNAME:PORT
    port = int(reported.rsplit(":", 1)[1])
    if host in _WILDCARD_HOSTS:
        address = reported
    else:
        address = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    connect_host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    service = LighthouseService(server, address, port, settings, connect_host)
    logger.info(
        "serving address=%s bind=%s min_replicas=%d join_timeout_ms=%d heartbeat_timeout_ms=%d "
        "quorum_tick_ms=%d",
        address, bind, min_replicas, join_timeout_ms, heartbeat_timeout_ms, quorum_tick_ms,
    )
    return service
