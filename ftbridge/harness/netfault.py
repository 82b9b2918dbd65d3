"""A TCP fault proxy on loopback: a link that a test or a chaos run can blackhole, or cut one way, at will.

Real clusters lose links in ways a killed process does not show: packets
dropped silently (a connect still succeeds through a proxy or a load balancer,
nothing comes back), or lost in one direction only. :class:`FaultProxy` stands
between a replica group and a server (the lighthouse) and relays both
directions in the ``pass`` mode; in the others it stops reading from the
sockets it would relay from, so the data waits in the kernel's buffers as TCP
keeps a connection's bytes while its packets are dropped, and flows again
when the link is whole:

* ``blackhole``: nothing crosses in either direction; new connections are
  still accepted (the proxy answers the handshake, as a hung host's kernel or
  a load balancer would);
* ``oneway``: the group's requests reach the server, the server's answers do
  not reach the group (a host that drops its inbound packets).

Example (a group's lighthouse address is the proxy's)::

    proxy = FaultProxy(("127.0.0.1", lighthouse_port))
    ... FTBRIDGE_LIGHTHOUSE=proxy.address ...
    proxy.set("blackhole"); ...; proxy.set("pass")
    proxy.close()

By hand, the same faults come from ``tc``/``iptables`` in a network namespace
(``docs/chaos.md``). It binds loopback unless told another local address (the
lighthouse's, when the groups run on hosts of their own).
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
from typing import Dict, Tuple

logger = logging.getLogger(__name__)

MODES = ("pass", "blackhole", "oneway")
CHUNK = 1 << 16


class FaultProxy:
    """Relays TCP connections from a loopback port to ``target``, with the link's fault set by :meth:`set`.

    Args:
        target: ``(host, port)`` of the server.
        bind_port: the proxy's port (0: a free one).
        bind_host: the proxy's address, a local one (default loopback; the groups' side of the link).

    Raises:
        OSError: the port cannot be bound.
    """

    def __init__(self, target: Tuple[str, int], bind_port: int = 0, bind_host: str = "127.0.0.1") -> None:
        self.target = target
        self.host = bind_host
        self._listener = socket.create_server((bind_host, bind_port))
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._mode = "pass"
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, "accept")
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._peer: Dict[socket.socket, socket.socket] = {}
        self._server_side: Dict[socket.socket, bool] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"ftbridge-fault-proxy-{self.port}", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        """``http://HOST:PORT``: give it to the replica group as the server's address."""
        return f"http://{self.host}:{self.port}"

    @property
    def mode(self) -> str:
        """The current fault: ``pass``, ``blackhole`` or ``oneway``."""
        return self._mode

    def set(self, mode: str) -> None:
        """Set the link's fault, for open and new connections (the relay thread applies it at once).

        Raises:
            ValueError: ``mode`` is not one of :data:`MODES`.
        """
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not one of {MODES}")
        self._mode = mode
        self._wake_w.send(b"x")

    def _reads(self, server_side: bool) -> bool:
        """Whether the proxy reads (and so relays) what arrives on a socket of this side."""
        return self._mode == "pass" or (self._mode == "oneway" and not server_side)

    def _sync(self) -> None:
        """Read only the sockets the current mode relays from; the others keep their bytes in the kernel."""
        registered = self._sel.get_map()
        for sock, server_side in self._server_side.items():
            if self._reads(server_side) and sock not in registered:
                self._sel.register(sock, selectors.EVENT_READ, "relay")
            elif not self._reads(server_side) and sock in registered:
                self._sel.unregister(sock)

    def _run(self) -> None:
        while not self._closed:
            self._sync()
            for key, _ in self._sel.select(timeout=0.5):
                if key.data == "accept":
                    self._accept()
                elif key.data == "wake":
                    self._wake_r.recv(64)
                elif key.fileobj in self._peer:
                    self._relay(key.fileobj)

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except OSError:
            return
        try:
            server = socket.create_connection(self.target, timeout=5)
        except OSError as exc:
            logger.debug("fault proxy %d: %s unreachable: %s", self.port, self.target, exc)
            client.close()
            return
        for sock, server_side in ((client, False), (server, True)):
            sock.setblocking(False)
            self._server_side[sock] = server_side
        self._peer[client], self._peer[server] = server, client

    def _relay(self, sock: socket.socket) -> None:
        if not self._reads(self._server_side[sock]):  # the mode changed since this select: keep the bytes
            return
        other = self._peer[sock]
        try:
            data = sock.recv(CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop(sock)
            return
        try:  # a bounded blocking send: the receiver's buffer may be full for a moment
            other.settimeout(5.0)
            other.sendall(data)
            other.setblocking(False)
        except OSError:
            self._drop(sock)

    def _drop(self, sock: socket.socket) -> None:
        for s in (sock, self._peer.get(sock)):
            if s is None:
                continue
            if s in self._sel.get_map():
                self._sel.unregister(s)
            self._peer.pop(s, None)
            self._server_side.pop(s, None)
            s.close()

    def close(self) -> None:
        """Stop relaying and close every connection (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._wake_w.send(b"x")
        self._thread.join(timeout=5)
        for s in list(self._peer):
            s.close()
        for s in (self._listener, self._wake_r, self._wake_w):
            s.close()
        self._sel.close()

    def __enter__(self) -> "FaultProxy":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def parse_target(address: str) -> Tuple[str, int]:
    """``(host, port)`` of ``http://HOST:PORT`` or ``HOST:PORT``.

    Raises:
        ValueError: no port.
    """
    rest = address.split("://", 1)[-1].rstrip("/")
    host, _, port = rest.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"address {address!r} has no port")
    return host or "127.0.0.1", int(port)


__all__ = ["MODES", "FaultProxy", "parse_target"]
