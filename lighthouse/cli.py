"""``ftbridge-lighthouse``: run and inspect torchft's lighthouse for an ftbridge job.

Usage::

    ftbridge-lighthouse serve                                  # 127.0.0.1:29510, health :29511, page :29512
    ftbridge-lighthouse serve --bind 0.0.0.0:29510             # other machines; see the warning
    ftbridge-lighthouse serve --exit-when-idle-s 300           # exit 0 after the job's groups are gone
    ftbridge-lighthouse status [--json] http://127.0.0.1:29510 # quorum and members
    ftbridge-lighthouse health 127.0.0.1:29511                 # exit 0 when SERVING

``serve`` checks its timeouts first (:mod:`lighthouse.checks`), prints its three addresses to stdout
once it listens, and runs until SIGTERM/SIGINT or idle. Exit codes: ``serve`` 0 after a signal or
once idle, 2 for a bad argument or timeouts that do not fit, 1 if an address cannot be bound;
``status`` 1 when the lighthouse cannot be read; ``health`` 0 for SERVING, 1 otherwise. Reference:
``docs/lighthouse.md`` and ``docs/cli.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Optional, Sequence

from ftbridge.device import is_loopback
from ftbridge.launch.cli_types import ArgumentParser, at_least, finite
from lighthouse import checks, server

if TYPE_CHECKING:
    from ftbridge.manager.lighthouse_status import LighthouseStatus

LOG_FORMAT = "%(asctime)s %(levelname)s [lighthouse] %(message)s"
HEALTH_PORT_OFFSET = 1
STATUS_PORT_OFFSET = 2
"""Default side ports: the --bind port plus these (29510 gives 29511 and 29512)."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser: one subcommand per action (``serve``, ``status``, ``health``)."""
    from ftbridge.config import FTBridgeConfig

    defaults = FTBridgeConfig()
    parser = ArgumentParser(prog="ftbridge-lighthouse", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser("serve", help="run the lighthouse (with health and status endpoints) until SIGTERM/SIGINT")
    serve.add_argument("--bind", default=server.DEFAULT_BIND,
                       help="HOST:PORT to listen on; port 0 picks a free one (default %(default)s)")
    serve.add_argument("--min-replicas", type=at_least(1), default=server.DEFAULT_MIN_REPLICAS,
                       help="fewest replica groups that form a quorum (default %(default)s)")
    serve.add_argument("--join-timeout-ms", type=at_least(0), default=server.DEFAULT_JOIN_TIMEOUT_MS,
                       help="how long a quorum waits for heartbeating groups that have not joined, ms "
                            "(default %(default)s; torchft's 60000 stalls a job a minute on a straggler)")
    serve.add_argument("--heartbeat-timeout-ms", type=at_least(1), default=server.DEFAULT_HEARTBEAT_TIMEOUT_MS,
                       help="silence after which a replica group is dead, ms (default %(default)s)")
    serve.add_argument("--quorum-tick-ms", type=at_least(1), default=server.DEFAULT_QUORUM_TICK_MS,
                       help="how often a pending quorum is re-checked, ms (default %(default)s)")
    serve.add_argument("--health-bind", default=None,
                       help="HOST:PORT of the gRPC health service (grpc.health.v1); default: the --bind host, "
                            "the --bind port + 1 (0 when --bind uses port 0); 'none' disables it")
    serve.add_argument("--status-bind", default=None,
                       help="HOST:PORT of the HTTP status page (/, /status.json, /metrics, /healthz); default: "
                            "the --bind host, the --bind port + 2 (0 when --bind uses port 0); 'none' disables it")
    serve.add_argument("--probe-interval-s", type=finite(0.0, strictly_above=True), default=1.0,
                       help="seconds between health probes of the lighthouse (default %(default)s)")
    serve.add_argument("--exit-when-idle-s", type=finite(0.0), default=0.0,
                       help="exit 0 once no replica group has heartbeated for this long after the first quorum "
                            "(the job ended; TorchX and batch jobs then end too); 0: never (default)")
    group = serve.add_argument_group("managers' settings, checked against the lighthouse's (lighthouse.checks)")
    group.add_argument("--manager-heartbeat-interval-ms", type=finite(0.0, strictly_above=True),
                       default=defaults.heartbeat_interval.total_seconds() * 1e3,
                       help="FTBRIDGE_HEARTBEAT_INTERVAL_MS of the job (default %(default)g)")
    group.add_argument("--manager-quorum-timeout-s", type=finite(0.0, strictly_above=True),
                       default=defaults.quorum_timeout.total_seconds(),
                       help="FTBRIDGE_QUORUM_TIMEOUT_S of the job (default %(default)g)")
    group.add_argument("--manager-cross-replica-timeout-s", type=finite(0.0, strictly_above=True),
                       default=defaults.cross_replica_timeout.total_seconds(),
                       help="FTBRIDGE_CROSS_REPLICA_TIMEOUT_S of the job (default %(default)g)")
    group.add_argument("--manager-quorum-retries", type=at_least(0), default=defaults.quorum_retries,
                       help="FTBRIDGE_QUORUM_RETRIES of the job (default %(default)s)")
    group.add_argument("--expected-heal-time-s", type=finite(0.0, strictly_above=True), default=1.0,
                       help="how long one heal transfer takes, s (default %(default)g)")
    group.add_argument("--expected-outage-s", type=finite(0.0, strictly_above=True), default=10.0,
                       help="longest lighthouse restart the job should ride out, s (default %(default)g)")
    serve.add_argument("--log-level", default="INFO", type=str.upper, choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                       help="level of this program's log lines (default %(default)s)")
    serve.set_defaults(func=_serve)

    status = sub.add_parser("status", help="print the current quorum and its members")
    status.add_argument("address", help="the lighthouse, http://HOST:PORT or HOST:PORT")
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.add_argument("--timeout-s", type=finite(0.0, strictly_above=True), default=5.0,
                        help="request timeout, s (default %(default)g)")
    status.set_defaults(func=_status)

    health = sub.add_parser("health", help="ask a gRPC health service; exit 0 when SERVING")
    health.add_argument("address", help="HOST:PORT of the health service (serve's --health-bind)")
    health.add_argument("--service", default="", help="service name (default: the overall status)")
    health.add_argument("--timeout-s", type=finite(0.0, strictly_above=True), default=5.0,
                        help="call deadline, s (default %(default)g)")
    health.set_defaults(func=_health)
    return parser


def _side_bind(given: Optional[str], bind: str, offset: int) -> Optional[str]:
    """The bind of a side endpoint: as given, ``None`` for 'none', else the --bind host and its port + ``offset``.

    --bind port 0 gives 0 (a free port). ValueError if port + ``offset`` exceeds 65535.
    """
    if given is not None:
        return None if given.lower() == "none" else given
    host, port = server.parse_bind(bind)
    host = f"[{host}]" if ":" in host else host
    if port and port + offset > 65535:
        raise ValueError(f"--bind port {port} leaves no room for the side endpoint at port + {offset}; "
                         "choose a lower --bind port or give --health-bind/--status-bind")
    return f"{host}:{port + offset if port else 0}"


def _check_timeouts(args: argparse.Namespace) -> None:
    findings = checks.check_timeouts(
        checks.LighthouseTimeouts(heartbeat_timeout_ms=args.heartbeat_timeout_ms,
                                  join_timeout_ms=args.join_timeout_ms, quorum_tick_ms=args.quorum_tick_ms),
        checks.ManagerTimeouts(heartbeat_interval=timedelta(milliseconds=args.manager_heartbeat_interval_ms),
                               quorum_timeout=timedelta(seconds=args.manager_quorum_timeout_s),
                               cross_replica_timeout=timedelta(seconds=args.manager_cross_replica_timeout_s),
                               quorum_retries=args.manager_quorum_retries,
                               expected_heal_time=timedelta(seconds=args.expected_heal_time_s),
                               expected_outage=timedelta(seconds=args.expected_outage_s)),
    )
    checks.enforce(findings)


def _serve(args: argparse.Namespace) -> int:
    from lighthouse.health import LighthouseMonitor

    stop = threading.Event()
    received: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        received.append(signum)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    monitor = None
    try:
        try:
            health_bind = _side_bind(args.health_bind, args.bind, HEALTH_PORT_OFFSET)
            status_bind = _side_bind(args.status_bind, args.bind, STATUS_PORT_OFFSET)
            for name, value in (("--health-bind", health_bind), ("--status-bind", status_bind)):
                if value is not None:
                    host, _ = server.parse_bind(value)
                    if not is_loopback(host):
                        logging.getLogger("lighthouse").warning(
                            "exposed %s=%s: health and status endpoints have no authentication "
                            "(they only read); keep them on a private network", name, value)
            _check_timeouts(args)
            if args.exit_when_idle_s < 0 or (args.exit_when_idle_s and health_bind is None and status_bind is None):
                raise ValueError(f"--exit-when-idle-s {args.exit_when_idle_s}: give seconds >= 0, and keep the "
                                 "health or status endpoint on (it reads the heartbeats)")
            service = server.start_lighthouse(
                args.bind, args.min_replicas,
                join_timeout_ms=args.join_timeout_ms,
                heartbeat_timeout_ms=args.heartbeat_timeout_ms,
                quorum_tick_ms=args.quorum_tick_ms,
            )
        except ValueError as exc:
            print(f"ftbridge-lighthouse: error: {exc}", file=sys.stderr, flush=True)
            return 2
        except OSError as exc:
            print(f"ftbridge-lighthouse: error: {exc}", file=sys.stderr, flush=True)
            return 1
        with service:
            if health_bind is not None or status_bind is not None:
                try:
                    monitor = LighthouseMonitor(service.local_address, health_bind=health_bind or "127.0.0.1:0",
                                                status_bind=status_bind, probe_interval_s=args.probe_interval_s)
                except (OSError, ValueError, RuntimeError) as exc:
                    print(f"ftbridge-lighthouse: error: health/status endpoints ({health_bind}, {status_bind}): {exc}; "
                          "choose other ports with --health-bind/--status-bind, or 'none'", file=sys.stderr, flush=True)
                    return 1
            print(f"ftbridge-lighthouse: serving on {service.address}", flush=True)
            if monitor is not None and health_bind is not None:
                print(f"ftbridge-lighthouse: health on {monitor.health_address}", flush=True)
            if monitor is not None and monitor.page is not None:
                print(f"ftbridge-lighthouse: status page on http://{monitor.page.address}/", flush=True)
            idle = IdleTimer(args.exit_when_idle_s)
            while not stop.wait(1.0):  # a timed wait keeps signal handling prompt everywhere
                if monitor is not None and idle.expired(monitor.last_status, time.monotonic()):
                    logging.getLogger("lighthouse").info(
                        "no replica group heartbeated for %.0f s after the job's quorums: exiting",
                        args.exit_when_idle_s)
                    break
            if received:
                logging.getLogger("lighthouse").info(
                    "shutting down signal=%s", signal.Signals(received[0]).name)
            if monitor is not None:
                monitor.shutdown()
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class IdleTimer:
    """Whether a job's replica groups are all gone: ``serve --exit-when-idle-s``.

    Expires once, after a quorum was issued, no replica id has had a fresh heartbeat for ``limit_s``
    seconds without a break; ``limit_s`` 0 never expires.
    """

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self._since: Optional[float] = None

    def expired(self, status: Optional["LighthouseStatus"], now: float) -> bool:
        """Feed one snapshot (``None``: not probed yet) taken at ``now`` (monotonic seconds)."""
        idle = (status is not None and status.previous_quorum_id is not None
                and not any(not h.stale for h in status.heartbeats))
        if not idle or not self.limit_s:
            self._since = None
            return False
        if self._since is None:
            self._since = now
        return now - self._since >= self.limit_s


def _status(args: argparse.Namespace) -> int:
    from ftbridge.manager.lighthouse_status import fetch_status
    from lighthouse.status import format_json, format_table

    try:
        status = fetch_status(args.address, timeout_s=args.timeout_s)
    except ValueError as exc:  # StatusFormatError, or an address that is not http
        print(f"ftbridge-lighthouse: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except OSError as exc:
        hint = ("; give the lighthouse's own address (ftbridge-lighthouse serve --bind), not another port of it"
                if getattr(exc, "code", None) == 404 else "")
        print(f"ftbridge-lighthouse: error: cannot read the status of {args.address}: {exc}{hint}",
              file=sys.stderr, flush=True)
        return 1
    print(format_json(status) if args.json else format_table(status), flush=True)
    return 0


def _health(args: argparse.Namespace) -> int:
    import grpc

    from lighthouse.health import check_health

    try:
        state = check_health(args.address, args.service, timeout_s=args.timeout_s)
    except grpc.RpcError as exc:
        state = f"UNREACHABLE ({exc.code().name})"
    print(json.dumps({"address": args.address, "service": args.service, "status": state}), flush=True)
    return 0 if state == "SERVING" else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``ftbridge-lighthouse``; returns the exit code.

    Raises:
        SystemExit: only from argparse, for ``--help`` (0) or unparsable flags (2).
    """
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "INFO"), format=LOG_FORMAT,
                        datefmt="%Y-%m-%d %H:%M:%S", stream=sys.stderr)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
