"""Run torchft's lighthouse in-process, with ftbridge's defaults and checks.

The lighthouse is torchft's own Rust server
(``torchft.coordination.LighthouseServer``, imported through
:mod:`ftbridge.manager.torchft_api`); this module only validates the
arguments, chooses defaults suited to fast failover, fixes the address it
reports, and warns when it is exposed beyond loopback. It keeps its state in
memory only: after a restart quorum ids start again at 0.

What the lighthouse serves, on one port (gRPC and HTTP share it):

* gRPC ``LighthouseService{Quorum, Heartbeat}``, called by each replica
  group's torchft ``Manager`` (group rank 0);
* HTTP ``GET /`` (dashboard), ``GET /status`` (HTML fragment) and
  ``POST /replica/{id}/kill`` (makes that group's rank 0 exit), all without
  authentication.

How the timeouts interact (torchft 0.2.0, measured)::

    quorum formed when  joined >= min_replicas
                   and  joined >  heartbeating / 2          (split-brain guard)
                   and (every heartbeating group joined
                        or join_timeout_ms passed since the first join)
    a group counts as heartbeating until heartbeat_timeout_ms after its last beat

``join_timeout_ms`` therefore only bounds how long the groups that asked for a
quorum wait for groups that heartbeat but have not asked yet. torchft's
default (60000 ms) makes a job wait up to a minute for such a straggler;
ftbridge uses :data:`DEFAULT_JOIN_TIMEOUT_MS` (1000 ms): a straggler slower
than that is left out of this quorum and joins at the next step by healing
from a peer, which costs far less than a minute of idle groups. A group that
died stops heartbeating and is forgotten after ``heartbeat_timeout_ms``.

Example::

    from lighthouse.server import start_lighthouse

    with start_lighthouse(min_replicas=2) as lh:
        os.environ["TORCHFT_LIGHTHOUSE"] = lh.address   # http://127.0.0.1:PORT
        ...
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
"""How long a quorum waits for heartbeating groups that have not joined yet (ms).

torchft's default is 60000 ms; see the module docstring for why 1000 ms."""

DEFAULT_HEARTBEAT_TIMEOUT_MS = 5000
"""A group silent for this long is considered dead (ms); torchft's default."""

DEFAULT_QUORUM_TICK_MS = 100
"""How often the lighthouse re-checks whether a quorum can form (ms)."""

_WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def parse_bind(bind: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` (IPv6 as ``[ADDR]:PORT``) into host and port.

    Args:
        bind: e.g. ``127.0.0.1:29510``, ``0.0.0.0:0``, ``[::1]:0``,
            ``localhost:29510``. Port 0 picks a free port.

    Returns:
        ``(host, port)`` with IPv6 brackets removed.

    Raises:
        ValueError: not ``HOST:PORT``, empty host, or a port outside 0-65535.
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
        """Check every value; return the parsed ``(host, port)`` of ``bind``.

        Raises:
            ValueError: naming the bad value and the fix.
        """
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
        address: ``http://HOST:PORT`` clients should use (``TORCHFT_LIGHTHOUSE``).
            HOST is the host that was bound (torchft itself reports the machine's
            hostname, which may not resolve to a loopback bind); for a wildcard
            bind (``0.0.0.0``, ``::``) it is the hostname torchft reports.
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
        """Stop serving and wait until the port refuses connections. Idempotent.

        torchft's ``shutdown()`` only aborts the server's task and returns at
        once. If that task has not run yet (a shutdown right after start), the
        abort is lost and the listening socket stays open for as long as the
        ``LighthouseServer`` object lives (seen in 1 of 20 tries here). So this
        also drops the object, which closes the socket and stops torchft's
        runtime, then waits until the port refuses connections, so it can be
        bound again when this returns.

        Args:
            timeout_s: how long to wait for the port to close (s); on expiry a
                WARNING is logged and the call returns anyway.
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
    """Validate the arguments, then start torchft's lighthouse in this process.

    The server runs on torchft's own threads; this call returns once it
    listens. Use it as a context manager, or call ``shutdown()``.

    Args:
        bind: ``HOST:PORT`` to listen on; port 0 picks a free port. Binding
            anything but loopback logs a WARNING: the lighthouse and the
            managers it coordinates have no authentication.
        min_replicas: fewest replica groups that form a quorum (>= 1).
        join_timeout_ms: how long a quorum waits for heartbeating groups that
            have not asked to join yet (ms, > 0).
        heartbeat_timeout_ms: silence after which a group is dead (ms, > 0).
        quorum_tick_ms: how often a pending quorum is re-checked (ms, > 0,
            below ``heartbeat_timeout_ms``).

    Returns:
        A :class:`LighthouseService` with ``.address`` and ``.shutdown()``.

    Raises:
        ValueError: a bad argument (raised before anything is started).
        OSError: the address is taken or cannot be bound (torchft's error kept
            as the cause).
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
