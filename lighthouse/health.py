"""Health and status endpoints for a torchft lighthouse (``docs/lighthouse.md``, "Health checks").

:class:`LighthouseMonitor` probes a lighthouse with ``GET /status`` every ``probe_interval_s`` and
publishes the result as a gRPC health service (``grpc.health.v1.Health``; ``""`` and
:data:`LIGHTHOUSE_SERVICE` answer ``SERVING`` or ``NOT_SERVING``) and optionally a :class:`StatusPage`
(``/``, ``/status.json``, ``/metrics``, ``/healthz``). It never changes the lighthouse's state and
keeps answering ``NOT_SERVING`` while the lighthouse is down. :func:`check_health` is the client.

Example::

    with LighthouseMonitor("http://127.0.0.1:29510", health_bind="127.0.0.1:29511") as mon:
        ...   # grpc health on mon.health_port
"""

from __future__ import annotations

import html
import json
import logging
import socket
import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ftbridge.manager.lighthouse_status import LighthouseStatus, fetch_status
from lighthouse.metrics import registry_for

logger = logging.getLogger("lighthouse")

LIGHTHOUSE_SERVICE = "torchft.LighthouseService"
"""Service name the health service reports besides the overall ``""``."""

DEFAULT_PROBE_INTERVAL_S = 1.0
DEFAULT_PROBE_TIMEOUT_S = 2.0


class LighthouseMonitor:
    """Probe a lighthouse and serve gRPC health (and optionally a status page).

    The first probe runs before this returns, so it never answers ``SERVING`` for a lighthouse not reached.

    Args:
        lighthouse: address of the lighthouse, ``http://HOST:PORT``.
        health_bind: ``HOST:PORT`` of the gRPC health service; port 0 picks a free one (:attr:`health_port`).
            A taken port is refused, never shared.
        status_bind: ``HOST:PORT`` of the HTTP status page, or ``None`` for none.
        probe_interval_s: seconds between probes (> 0).
        probe_timeout_s: timeout of one probe (s, > 0).

    Raises:
        ValueError: a bad bind or interval.
        OSError: a port cannot be bound.
    """

    def __init__(self, lighthouse: str, *, health_bind: str, status_bind: Optional[str] = None,
                 probe_interval_s: float = DEFAULT_PROBE_INTERVAL_S,
                 probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S) -> None:
        from lighthouse.server import parse_bind

        if not probe_interval_s > 0 or not probe_timeout_s > 0:
            raise ValueError(f"probe_interval_s={probe_interval_s}, probe_timeout_s={probe_timeout_s}: "
                             "both must be positive seconds")
        parse_bind(health_bind)
        self.lighthouse = lighthouse
        self.probe_interval_s = probe_interval_s
        self.probe_timeout_s = probe_timeout_s
        self.last_status: Optional[LighthouseStatus] = None
        self.last_error: Optional[str] = None
        self.last_success_monotonic: Optional[float] = None
        """``time.monotonic()`` of the last successful probe (``None`` before one)."""
        self.serving = False
        self._lock = threading.Lock()
        self._stop = threading.Event()

        self._health = health.HealthServicer()
        # No SO_REUSEPORT (gRPC's default): a second lighthouse must fail on a taken health port, not share it.
        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="lh-health"),
                                 options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._grpc)
        try:
            port = self._grpc.add_insecure_port(health_bind)
        except RuntimeError as exc:  # grpcio raises when the address is taken
            raise OSError(f"cannot bind the health service on health_bind={health_bind!r}: {exc}") from exc
        if port == 0:
            raise OSError(f"cannot bind the health service on health_bind={health_bind!r}")
        self.health_port = port
        self.health_address = f"{health_bind.rpartition(':')[0]}:{port}"
        self.page: Optional[StatusPage] = StatusPage(self, status_bind) if status_bind else None

        self.probe()  # first answer before anyone can ask
        self._grpc.start()
        self._thread = threading.Thread(target=self._run, name="lighthouse-probe", daemon=True)
        self._thread.start()
        logger.info("health service on %s (grpc.health.v1) probing %s every %.1fs%s",
                    self.health_address, lighthouse, probe_interval_s,
                    f"; status page http://{self.page.address}/" if self.page else "")

    def probe(self) -> bool:
        """Probe once, publish the result; return whether the lighthouse answered."""
        try:
            status = fetch_status(self.lighthouse, timeout_s=self.probe_timeout_s)
            error = None
        except Exception as exc:  # noqa: BLE001 - unreachable, HTTP error or unparsable page: not serving
            status, error = None, f"{type(exc).__name__}: {exc}"
        ok = status is not None
        with self._lock:
            changed = ok != self.serving
            self.serving = ok
            self.last_error = error
            if ok:
                self.last_status = status
                self.last_success_monotonic = time.monotonic()
        value = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", LIGHTHOUSE_SERVICE):
            self._health.set(service, value)
        if changed:
            if status is not None:
                logger.info("health SERVING lighthouse=%s quorum_id=%d", self.lighthouse, status.quorum_id)
            else:
                logger.warning("health NOT_SERVING lighthouse=%s error=%s", self.lighthouse, error)
        return ok

    def _run(self) -> None:
        while not self._stop.wait(self.probe_interval_s):
            self.probe()

    def shutdown(self) -> None:
        """Stop probing and serving (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._health.enter_graceful_shutdown()
        self._grpc.stop(grace=0.5).wait(5)
        if self.page is not None:
            self.page.shutdown()
        self._thread.join(timeout=self.probe_interval_s + self.probe_timeout_s + 1)

    def __enter__(self) -> "LighthouseMonitor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def check_health(address: str, service: str = "", timeout_s: float = 5.0) -> str:
    """Ask a gRPC health service for ``service``'s status; ignores proxy settings.

    Args:
        address: ``HOST:PORT`` of the health service.
        service: service name (``""`` for the overall status).
        timeout_s: deadline of the call (s).

    Returns:
        ``"SERVING"``, ``"NOT_SERVING"``, ``"SERVICE_UNKNOWN"`` or ``"UNKNOWN"``.

    Raises:
        grpc.RpcError: unreachable (``UNAVAILABLE``), past the deadline, or ``service`` unknown (``NOT_FOUND``).
    """
    # grpc honours http_proxy/grpc_proxy by default; a health probe of the private network must not.
    with grpc.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)]) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


_PAGE_CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse}td,th{border:1px solid #bbb;padding:.25em .6em;text-align:left}
th{background:#eee}.bad{color:#b00;font-weight:bold}.ok{color:#070;font-weight:bold}
.recovering{background:#ffe2b0}.stale{color:#b00}code{background:#f4f4f4}
"""


def render_page(status: Optional[LighthouseStatus], *, lighthouse: str, serving: bool,
                error: Optional[str], refresh_s: int = 2) -> str:
    """The self-contained status page: a complete HTML document with no script and no external resource.

    Args:
        status: the last successful snapshot (shown as last known while the lighthouse is down), or ``None``.
        lighthouse: its address, shown in the title.
        serving: whether the last probe succeeded.
        error: the last probe's error, when it failed.
        refresh_s: the page reloads itself this often (s).
    """
    esc = html.escape
    parts = [f'<!doctype html><html><head><meta charset="utf-8"><meta http-equiv="refresh" content="{refresh_s}">',
             f"<title>lighthouse {esc(lighthouse)}</title><style>{_PAGE_CSS}</style></head><body>",
             f"<h1>torchft lighthouse <code>{esc(lighthouse)}</code></h1>"]
    if serving:
        parts.append('<p>health: <span class="ok">SERVING</span></p>')
    else:
        parts.append(f'<p>health: <span class="bad">NOT_SERVING</span> ({esc(error or "")})'
                     + (" &mdash; last known state below" if status else "") + "</p>")
    if status is not None:
        parts.append(f"<p>quorum_id <b>{status.quorum_id}</b>; next quorum: {esc(status.next_quorum)}</p>")
        if status.previous_quorum_id is None:
            parts.append("<p>no quorum issued yet</p>")
        else:
            age = "-" if status.quorum_age_s is None else f"{status.quorum_age_s:.1f} s"
            parts.append(f"<h2>Last quorum {status.previous_quorum_id} ({len(status.members)} members, "
                         f"issued {age} ago)</h2><table><tr><th>group</th><th>replica id</th><th>step</th>"
                         "<th>group size</th><th>manager</th><th>heartbeat</th><th>state</th></tr>")
            for m in sorted(status.members, key=lambda m: m.replica_id):
                hb = "-" if m.heartbeat_age_s is None else f"{m.heartbeat_age_s:.1f} s"
                group = "-" if m.replica_group is None else m.replica_group
                parts.append(f'<tr class="{"recovering" if m.recovering else ""}"><td>{group}</td>'
                             f"<td>{esc(m.replica_id)}</td><td>{m.step}</td><td>{m.world_size}</td>"
                             f"<td>{esc(m.manager_address)}</td><td>{hb}</td>"
                             f"<td>{'recovering' if m.recovering else 'ok'}</td></tr>")
            parts.append("</table>")
        parts.append("<h2>Heartbeats</h2><ul>")
        for h in sorted(status.heartbeats, key=lambda h: h.replica_id):
            parts.append(f'<li class="{"stale" if h.stale else ""}">{esc(h.replica_id)}: {h.age_s:.1f} s ago'
                         f'{" (stale)" if h.stale else ""}</li>')
        parts.append("</ul>")
    parts.append(f"<p><small>generated {time.strftime('%Y-%m-%d %H:%M:%S')}; JSON at "
                 '<a href="status.json">status.json</a></small></p></body></html>')
    return "".join(parts)


class StatusPage:
    """HTTP server for :class:`LighthouseMonitor`'s snapshot: ``/``, ``/status.json``, ``/metrics``, ``/healthz``.

    Args:
        monitor: the monitor whose last probe is shown.
        bind: ``HOST:PORT``; port 0 picks a free one.

    Raises:
        OSError: the port cannot be bound.
    """

    def __init__(self, monitor: LighthouseMonitor, bind: str) -> None:
        from lighthouse.server import parse_bind

        host, port = parse_bind(bind)
        page = self
        self.registry = registry_for(monitor)

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                with monitor._lock:
                    status, serving, error = monitor.last_status, monitor.serving, monitor.last_error
                if path in ("/", "/index.html"):
                    page._send(self, 200, "text/html; charset=utf-8",
                               render_page(status, lighthouse=monitor.lighthouse, serving=serving, error=error))
                elif path == "/status.json":
                    body: Any = {"lighthouse": monitor.lighthouse, "serving": serving, "error": error,
                                 "status": status.to_json() if status else None}
                    page._send(self, 200, "application/json", json.dumps(body, indent=2))
                elif path == "/metrics":
                    page._send(self, 200, CONTENT_TYPE_LATEST, generate_latest(page.registry).decode("utf-8"))
                elif path == "/healthz":
                    page._send(self, 200 if serving else 503, "text/plain",
                               "SERVING\n" if serving else "NOT_SERVING\n")
                else:
                    page._send(self, 404, "text/plain", "not found: try /, /status.json, /metrics or /healthz\n")

            def log_message(self, fmt: str, *args: Any) -> None:
                logger.debug("status page: " + fmt, *args)

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server_cls = type("_PageServer", (ThreadingHTTPServer,), {"address_family": family})
        self._server = server_cls((host, port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.address = f"[{host}]:{self.port}" if family == socket.AF_INET6 else f"{host}:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="lighthouse-page", daemon=True)
        self._thread.start()

    @staticmethod
    def _send(handler: BaseHTTPRequestHandler, code: int, ctype: str, text: str) -> None:
        body = text.encode("utf-8")
        handler.send_response(code)
        handler.send_header("Content-Type", ctype)
        handler.send_header("Content-Length", str(len(body)))
        handler.send_header("Cache-Control", "no-store")
        handler.end_headers()
        handler.wfile.write(body)

    def shutdown(self) -> None:
        """Stop serving and close the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
