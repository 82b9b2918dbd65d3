"""Heal transport: serves a healthy rank's live state to a joining replica group.

:class:`SafeHTTPTransport` implements torchft's ``CheckpointTransport`` (``send_checkpoint`` on the donor,
``recv_checkpoint`` on the joiner, ``disallow_checkpoint`` once the donor's state may change) over HTTP
with the pickle-free format of :mod:`ftbridge.heal.wire`, bound to one interface, with both ends bounded
(:mod:`ftbridge.heal.limits`) and an optional job token.

Why (instead of torchft's ``HTTPTransport``) and how it is fast: docs/concepts.md, "Heal" (Transport);
the threats and limits: docs/lighthouse.md, "The heal path"; measurements: docs/measurements.md,
"Heal at link speed".
"""

from __future__ import annotations

import http.client
import logging
import re
import socket
import sys
import threading
import time
import urllib.error
from datetime import timedelta
from http.server import BaseHTTPRequestHandler
from typing import Any, Callable, Dict, List, Optional, cast

from ftbridge import faults
from ftbridge.heal.limits import (
    AUTH_SCHEME,
    REAPER,
    BoundedHTTPServer,
    check_heal_url,
    host_of,
    mac_matches,
    request_mac,
)
from ftbridge.heal.stream import BodyAborted, ReceiveBuffer, StreamBody, fresh_buffer, read_tensors
from ftbridge.heal.wire import decode_parts, decode_state, encode_state, header_length, plan_body
from ftbridge.manager.torchft_api import CheckpointTransport
from ftbridge.staging import Staging

__all__ = ["SafeHTTPTransport", "decode_parts", "decode_state", "encode_state"]

logger = logging.getLogger(__name__)

MAX_CONNECTIONS = 16
"""Heal requests a donor serves at once; more are closed unread."""
SERVING_SWITCH_INTERVAL_S = 0.0005
"""Python's GIL switch interval (s) while a donor serves a heal; restored by
:meth:`SafeHTTPTransport.disallow_checkpoint`."""
_CONTENT_LENGTH = re.compile(r"[0-9]{1,20}")


def _recv_exact(resp: Any, sock: socket.socket, view: memoryview) -> int:
    """Fill ``view`` with the body: ``http.client``'s buffered bytes, then one blocking ``MSG_WAITALL`` read; the bytes
    read."""
    got = resp.fp.readinto1(view) if len(view) else 0  # bytes buffered with the headers, at most one raw read
    sock.settimeout(None)
    while got < len(view):
        k = sock.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)
        if not k:
            break
        got += k
    return got


class SafeHTTPTransport(CheckpointTransport[Dict[str, Any]]):
    """torchft checkpoint transport over HTTP with a pickle-free format and bounded ends.

    Args:
        bind: interface address to listen on, e.g. ``"127.0.0.1"``; the OS picks the port.
        timeout: the donor's bound on receiving a request, and on waiting for the requested step.
        heal_timeout: overall deadline of one fetch, and the donor's for one response; ``None``: the
            ``timeout`` torchft passes to :meth:`recv_checkpoint` (the donor allows ``2 * timeout``).
        max_recv_bytes: returns the largest body this rank accepts (bytes, headers included), called at each
            fetch and by :meth:`prepare_recv`; a larger announced body is refused before anything is allocated.
        token: the job token (``FTBRIDGE_JOB_TOKEN``); ``None`` or empty: no authentication.
        max_connections: requests served at once; more are closed unread.
        device: where received tensors go (CUDA: through :mod:`ftbridge.staging`); ``None``: CPU tensors.

    Raises:
        OSError: ``bind`` is not an address of this machine.
    """

    def __init__(self, bind: str, timeout: timedelta, *, max_recv_bytes: Callable[[], int],
                 heal_timeout: Optional[timedelta] = None, token: Optional[str] = None,
                 max_connections: int = MAX_CONNECTIONS, device: Any = None) -> None:
        self._timeout = timeout
        self._device = device
        self._staging = Staging()
        self._heal_timeout = heal_timeout
        self._token = token or None
        self._max_recv_bytes = max_recv_bytes
        self._donor_host: Optional[str] = None
        self._cond = threading.Condition()
        self._body: Optional[StreamBody] = None
        self._recv_buffer: Optional[ReceiveBuffer] = None
        self._saved_switch_interval: Optional[float] = None
        self._step = -1
        self.last_recv: Optional[Dict[str, Any]] = None
        """Timing of the last successful fetch: ``bytes`` and wall times (s since the epoch) ``start``, ``response``,
        ``fetched``, ``end``."""
        family = socket.AF_INET6 if ":" in bind else socket.AF_INET
        send_s = (heal_timeout or 2 * timeout).total_seconds()
        self._server = BoundedHTTPServer((bind, 0), self._handler_class(), family=family,
                                         max_connections=max_connections,
                                         request_timeout_s=timeout.total_seconds(),
                                         response_deadline_s=timeout.total_seconds() + send_s)
        self._server.timeout = timeout.total_seconds()
        host = f"[{bind}]" if family == socket.AF_INET6 else bind
        self._address = f"http://{host}:{self._server.server_address[1]}/heal/"
        self._thread = threading.Thread(target=self._server.serve_forever, name="ftbridge-heal", daemon=True)
        self._thread.start()
        logger.info("heal transport serving on %s (%s)", self._address,
                    "job token required" if self._token else "no job token: anyone reaching it may fetch")

    def _handler_class(self) -> type:
        transport = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                parts = self.path.strip("/").split("/")
                if len(parts) != 2 or parts[0] != "heal" or not parts[1].isdigit() or not parts[1].isascii():
                    self.send_error(404, "expected /heal/STEP")
                    return
                step = int(parts[1])
                if transport._token and not mac_matches(transport._token, transport._address, step,
                                                        self.headers.get("Authorization")):
                    self.send_error(403, "heal request without this job's token (FTBRIDGE_JOB_TOKEN)")
                    return
                server = cast(BoundedHTTPServer, self.server)
                server.extend(self.connection)
                t_request = time.time()
                body = transport._wait_for(step)
                t_ready = time.time()
                if body is None:
                    self.send_error(409, f"step {step} is not being served")
                    return
                # A short last send goes out at once, not after the previous one's delayed ACK (Nagle).
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                # Headers, the body's prefix and its first chunk in one system call (sendmsg): each
                # call ends with this thread taking the GIL back from the training thread.
                self.log_request(200)
                head = (f"{self.protocol_version} 200 OK\r\nServer: {self.version_string()}\r\n"
                        f"Content-Type: application/octet-stream\r\nContent-Length: {body.size}\r\n\r\n").encode()
                # Blocking sends: the whole chunk in one system call rather than one per partial send;
                # the connection's deadline (REAPER) still ends a stuck send.
                self.connection.settimeout(None)
                try:  # sent from the donor's tensors, a GPU's through the pinned buffer (ftbridge.heal.stream)
                    body.serve(self.connection.sendmsg, cut=self._cut, head=head,
                               halfway=(lambda: faults.point("heal_send")) if faults.armed("heal_send") else None)
                except BodyAborted as e:  # the joiner sees a short body: ConnectionError
                    logger.info("heal transport: response for step %d cut short: %s", step, e)
                    self.close_connection = True
                    return
                logger.info("heal transport: served step %d, %.1f MB: the request waited %.1f ms for the state, "
                            "sent in %.1f ms", step, body.size / 1e6, (t_ready - t_request) * 1e3,
                            (time.time() - t_ready) * 1e3)

            def _cut(self) -> None:
                try:
                    self.connection.shutdown(socket.SHUT_RDWR)
                except OSError:  # already closed
                    pass

            def log_message(self, fmt: str, *args: Any) -> None:
                logger.debug("heal transport: " + fmt, *args)

        return Handler

    def _wait_for(self, step: int) -> Optional[StreamBody]:
        deadline = time.monotonic() + self._timeout.total_seconds()
        with self._cond:
            while self._body is None or self._step != step:
                if self._step > step:
                    return None
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._cond.wait(remaining):
                    return None
            return self._body

    def metadata(self) -> str:
        """URL prefix of this transport, passed to joiners through the quorum."""
        return self._address

    def expect_donor(self, manager_address: Optional[str]) -> None:
        """Fetch heal state only from the host of ``manager_address`` (the quorum's donor); ``None``: any host."""
        self._donor_host = host_of(manager_address) if manager_address else None

    def send_checkpoint(self, dst_ranks: List[int], step: int, state_dict: Dict[str, Any],
                        timeout: timedelta) -> None:
        """Serve ``state_dict`` for ``step`` until :meth:`disallow_checkpoint`; returns at once.

        Keeps a body already served for ``step`` (served early by :class:`ftbridge.manager.ReplicaManager`). The
        tensors in ``state_dict`` must not change before :meth:`disallow_checkpoint` (they are sent from). Lowers
        the GIL switch interval to :data:`SERVING_SWITCH_INTERVAL_S` meanwhile.

        Raises:
            TypeError: a leaf is neither tensor nor JSON scalar (before anything is served).
        """
        with self._cond:
            if self._body is not None and self._step == step:  # served early (ReplicaManager._serve_early)
                return
        t0 = time.perf_counter()
        plan = plan_body(state_dict)
        body = StreamBody(plan if plan is not None else encode_state(state_dict), staging=self._staging)
        with self._cond:
            self._body, self._step = body, step
            if self._saved_switch_interval is None and sys.getswitchinterval() > SERVING_SWITCH_INTERVAL_S:
                self._saved_switch_interval = sys.getswitchinterval()
                sys.setswitchinterval(SERVING_SWITCH_INTERVAL_S)
            self._cond.notify_all()
        logger.info("serving heal state for step %d to replica ranks %s: %.1f MB, laid out in %.4f s",
                    step, dst_ranks, body.size / 1e6,
                    time.perf_counter() - t0)

    def disallow_checkpoint(self) -> None:
        """Stop serving: the donor's state may change from here on.

        Responses in flight go on from a host copy of what they have not sent (a GPU state's too); one still
        blocked in a send from the live state after ``ftbridge.heal.stream.FREEZE_GRACE_S`` is cut off.
        """
        with self._cond:
            body, self._body = self._body, None
            saved, self._saved_switch_interval = self._saved_switch_interval, None
            if saved is not None and abs(sys.getswitchinterval() - SERVING_SWITCH_INTERVAL_S) < 1e-9:
                sys.setswitchinterval(saved)
            self._cond.notify_all()
        if body is not None:
            t0 = time.perf_counter()
            if not body.freeze():
                logger.warning("heal transport: a response still wrote from the live state after being cut off")
            if body.staged_bytes:
                logger.info("heal transport: kept %.1f MB not yet sent to joiners in %.3f s", body.staged_bytes / 1e6,
                            time.perf_counter() - t0)

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Dict[str, Any]:
        """Fetch and decode the donor's state for ``step`` within one overall deadline (``heal_timeout`` or
        ``timeout``).

        Raises:
            ValueError: ``metadata`` is not an allowed heal URL (:func:`ftbridge.heal.limits.check_heal_url`),
                the donor announces a body above ``max_recv_bytes``, or the body is malformed.
            TimeoutError: the deadline passed.
            urllib.error.HTTPError: a status other than 200 (403: wrong or missing job token; 409: step not served).
            OSError, http.client.HTTPException: the donor is unreachable or died; ``ConnectionError`` when the
                body ended early.
        """
        seconds = (self._heal_timeout or timeout).total_seconds()
        deadline = time.monotonic() + seconds
        host, port = check_heal_url(metadata, self._donor_host)
        url = f"{metadata}{int(step)}"
        limit = self._max_recv_bytes()
        headers = {"Authorization": f"{AUTH_SCHEME} {request_mac(self._token, metadata, step)}"} if self._token else {}
        t0, wall0 = time.perf_counter(), time.time()
        conn = http.client.HTTPConnection(host, port, timeout=seconds)
        sock = None
        try:
            conn.connect()
            sock = conn.sock
            REAPER.set(sock, deadline - time.monotonic())
            conn.request("GET", f"/heal/{int(step)}", headers=headers)
            resp = conn.getresponse()
            response = time.time()
            head, blob, size = self._read_body(resp, sock, url, step, limit, deadline)
        except Exception as e:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"heal state for step {step} from {url}: not received within the heal "
                                   f"deadline of {seconds:g} s ({type(e).__name__}: {e})") from e
            raise
        finally:
            if sock is not None:
                REAPER.remove(sock)
            conn.close()
        fetched = time.time()
        state = decode_parts(head, blob)
        self.last_recv = {"bytes": size, "start": wall0, "response": response, "fetched": fetched,
                          "end": time.time()}
        logger.info("received heal state for step %d from replica rank %d (%s): %.1f MB in %.3f s",
                    step, src_rank, url, size / 1e6, time.perf_counter() - t0)
        return state

    def _read_body(self, resp: Any, sock: socket.socket, url: str, step: int, limit: int, deadline: float) -> tuple:
        """``(JSON header, tensor blob, size)`` of a response, its size checked against ``limit`` before allocating."""
        if resp.status != 200:
            raise urllib.error.HTTPError(url, resp.status, resp.reason, resp.headers, None)
        length = (resp.getheader("Content-Length") or "").strip()
        if not _CONTENT_LENGTH.fullmatch(length):
            raise ValueError(f"heal state for step {step} from {url}: Content-Length {length[:40]!r} is not a size")
        size = int(length)
        if size > limit:
            raise ValueError(f"heal state for step {step} from {url}: the donor announces {size} bytes, more than "
                             f"a state like this rank's own can take ({limit} bytes with headers); refused before "
                             "allocating it")
        # Header and blob read apart, the blob straight into the buffer its tensors will view
        # (no concatenation or slicing copies of the whole body).
        prefix = resp.read(8)
        n = header_length(prefix, size)
        head = resp.read(n)
        faults.point("heal_recv")
        device = self._device
        if device is not None and getattr(device, "type", device) == "cuda":
            # Straight into tensors on the GPU, through the pinned staging buffer: no host copy of the body.
            return head, read_tensors(resp.readinto, size - 8 - n, device, self._staging), size
        blob = self._take_recv_buffer(size - 8 - n, deadline)
        got = _recv_exact(resp, sock, blob) + len(prefix) + len(head)
        if got != size:
            raise ConnectionError(f"heal state for step {step} from {url}: received {got} of {size} bytes "
                                  "(the donor died or the connection broke)")
        return head, blob, size

    def prepare_recv(self, wait_s: float = 0.0) -> None:
        """Map and touch memory for the next fetch now, in a background thread, waiting up to ``wait_s`` here.

        Sized by ``max_recv_bytes`` (nothing for a CUDA ``device``); the next fetch uses it if it is large enough;
        :meth:`release_recv` drops it unused.
        """
        if getattr(self._device, "type", self._device) != "cuda":
            self._recv_buffer = ReceiveBuffer(self._max_recv_bytes())  # (a CUDA joiner reads through ftbridge.staging)
            self._recv_buffer.wait(wait_s)

    def release_recv(self) -> None:
        """Drop a buffer from :meth:`prepare_recv` that no fetch used (its memory is returned)."""
        self._recv_buffer = None

    def _take_recv_buffer(self, nbytes: int, deadline: float) -> memoryview:
        """The prepared buffer if it fits (used once), else fresh memory: ``nbytes`` writable bytes."""
        prepared, self._recv_buffer = self._recv_buffer, None
        view = prepared.take(nbytes, deadline) if prepared is not None else None
        return view if view is not None else fresh_buffer(nbytes)

    def shutdown(self, wait: bool = True) -> None:
        """Stop the HTTP server."""
        self.disallow_checkpoint()
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join(timeout=5)
