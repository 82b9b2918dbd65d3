"""HTTP limits of the heal path: deadlines, a bounded server, the heal URL policy, the job token.

Both ends treat the other as hostile (threats: ``docs/lighthouse.md``, "The heal path"; deadlines:
``docs/heal.md``). :data:`REAPER` shuts each registered socket down at its deadline;
:class:`BoundedHTTPServer` caps connections and bounds each one's time; :func:`check_heal_url` admits
only ``http://HOST:PORT/heal/``; :func:`request_mac` / :func:`mac_matches` are the job-token HMAC
over the donor's address and the step (the token never travels).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import socket
import threading
import time
import urllib.parse
from http.server import ThreadingHTTPServer
from typing import Any, Dict, Optional, Tuple

logger = logging.getLogger(__name__)

AUTH_SCHEME = "FTBridge-HMAC"
"""``Authorization: FTBridge-HMAC <hex>`` carries :func:`request_mac` on a heal request."""


class _Reaper:
    """Shuts down registered sockets at their deadlines (one lazily started daemon thread)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._due: Dict[int, Tuple[float, socket.socket]] = {}
        self._thread: Optional[threading.Thread] = None

    def set(self, sock: socket.socket, seconds: float) -> None:
        """Shut ``sock`` down ``seconds`` from now unless :meth:`remove` comes first (replaces an earlier deadline)."""
        with self._cond:
            self._due[id(sock)] = (time.monotonic() + max(0.0, seconds), sock)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ftbridge-heal-deadlines", daemon=True)
                self._thread.start()
            self._cond.notify()

    def remove(self, sock: socket.socket) -> None:
        """Forget ``sock``."""
        with self._cond:
            self._due.pop(id(sock), None)

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                expired = [k for k, (t, _) in self._due.items() if t <= now]
                socks = [self._due.pop(k)[1] for k in expired]
                if not socks:
                    nxt = min((t for t, _ in self._due.values()), default=None)
                    self._cond.wait(None if nxt is None else nxt - now)
                    continue
            for s in socks:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:  # already closed by its owner
                    pass


REAPER = _Reaper()
"""The process's deadline thread, shared by the heal server and fetches."""


class BoundedHTTPServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` with a cap on connections and a deadline on each.

    Args:
        address: ``(host, port)`` to bind.
        handler: the request handler class.
        family: ``socket.AF_INET`` or ``socket.AF_INET6``.
        max_connections: connections served at once (>= 1); more are closed unread, with no thread.
        request_timeout_s: seconds from accept to a complete request; also each read's socket timeout.
        response_deadline_s: seconds after the request for the handler's wait and whole response
            (:meth:`extend`).

    Raises:
        ValueError: ``max_connections`` < 1.
        OSError: the address cannot be bound.
    """

    daemon_threads = True
    request_queue_size = 64  # connections past the cap are accepted and closed at once, not left in the backlog

    def __init__(self, address: Tuple[str, int], handler: Any, *, family: int, max_connections: int,
                 request_timeout_s: float, response_deadline_s: float) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections={max_connections} must be at least 1")
        self.address_family = family
        self.request_timeout_s = request_timeout_s
        self.response_deadline_s = response_deadline_s
        self._slots = threading.BoundedSemaphore(max_connections)
        self._active_cond = threading.Condition()
        self.active = 0
        """Connections being served now (each holds one thread)."""
        self.refused = 0
        """Connections closed unread because ``max_connections`` were being served."""
        self.peak_active = 0
        """Most connections served at once so far."""
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:  # socketserver API
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        with self._active_cond:
            self.active += 1
            self.peak_active = max(self.peak_active, self.active)
            self._active_cond.notify_all()
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:  # socketserver API
        request.settimeout(self.request_timeout_s)
        REAPER.set(request, self.request_timeout_s)
        try:
            super().process_request_thread(request, client_address)
        finally:
            REAPER.remove(request)
            self._release()

    def extend(self, request: Any) -> None:
        """The request was read: the connection gets :attr:`response_deadline_s` as deadline and socket timeout."""
        request.settimeout(self.response_deadline_s)
        REAPER.set(request, self.response_deadline_s)

    def _release(self) -> None:
        with self._active_cond:
            self.active -= 1
            self._active_cond.notify_all()
        self._slots.release()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no connection is being served; ``False`` if some still are after ``timeout_s``."""
        with self._active_cond:
            return self._active_cond.wait_for(lambda: self.active == 0, timeout_s)

    def handle_error(self, request: Any, client_address: Any) -> None:  # socketserver API
        # A client cut off at its deadline, or gone: one line, no traceback on stderr.
        import sys

        logger.info("heal transport: connection from %s ended: %s", client_address, sys.exc_info()[1])


def _norm_host(host: str) -> str:
    host = host.strip("[]").lower()
    try:
        return ipaddress.ip_address(host).compressed
    except ValueError:
        return host


def host_of(address: str) -> Optional[str]:
    """The host of ``http://HOST:PORT`` (a torchft manager address), or ``None`` if it has none."""
    try:
        return urllib.parse.urlsplit(address).hostname or None
    except ValueError:
        return None


def check_heal_url(metadata: str, expected_host: Optional[str]) -> Tuple[str, int]:
    """``(host, port)`` of a donor's heal URL prefix, if a joiner may fetch from it.

    Args:
        metadata: the donor's ``http://HOST:PORT/heal/`` as torchft passes it on.
        expected_host: the donor's manager host as the quorum names it; ``None`` accepts any host.

    Raises:
        ValueError: another scheme, credentials, a query or fragment, another path, no port, whitespace
            or control characters, or a host other than ``expected_host``.
    """
    if not isinstance(metadata, str) or not metadata.isprintable() or any(c.isspace() for c in metadata):
        raise ValueError(f"heal URL {str(metadata)[:200]!r} is not a printable URL")
    try:
        parts = urllib.parse.urlsplit(metadata)
        host, port = parts.hostname, parts.port
    except ValueError as e:
        raise ValueError(f"heal URL {metadata[:200]!r} is malformed: {e}") from None
    if (parts.scheme != "http" or parts.username is not None or parts.password is not None or parts.query
            or parts.fragment or parts.path != "/heal/" or not host or not port):
        raise ValueError(f"heal URL {metadata[:200]!r} is not http://HOST:PORT/heal/ (the only form a donor "
                         "advertises); refusing it")
    if expected_host is not None and _norm_host(host) != _norm_host(expected_host):
        raise ValueError(f"heal URL {metadata[:200]!r} points at host {host!r}, not at the donor {expected_host!r} "
                         "that the quorum names; refusing it")
    return host, port


def request_mac(token: str, address: str, step: int) -> str:
    """Hex HMAC-SHA256 with key ``token`` over the donor's advertised heal ``address`` and ``step``."""
    msg = f"ftbridge-heal-v1\n{address}\n{int(step)}".encode()
    return hmac.new(token.encode(), msg, hashlib.sha256).hexdigest()


def mac_matches(token: str, address: str, step: int, authorization: Optional[str]) -> bool:
    """Whether an ``Authorization`` header carries :func:`request_mac` for this donor and step (constant time)."""
    want = f"{AUTH_SCHEME} {request_mac(token, address, step)}".encode()
    got = (authorization or "").encode("latin-1", errors="replace")
    return hmac.compare_digest(got, want)
