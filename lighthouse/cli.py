"""``ftbridge-lighthouse``: run torchft's lighthouse for an ftbridge job.

Usage::

    ftbridge-lighthouse serve                                  # 127.0.0.1:29510
    ftbridge-lighthouse serve --bind 127.0.0.1:0 --min-replicas 2
    ftbridge-lighthouse serve --bind 0.0.0.0:29510             # other machines; see the warning

``serve`` prints one line to stdout once it listens, then runs until SIGTERM
or SIGINT, and exits 0::

    ftbridge-lighthouse: serving on http://127.0.0.1:29510

Point every launcher at that address (``ftbridge-run --lighthouse URL`` or
``TORCHFT_LIGHTHOUSE``). Logs go to stderr, one line each:
``2026-11-29 21:40:01 INFO [lighthouse] serving address=... min_replicas=1 ...``
(torchft's own Rust logs keep their format). Exit codes: 0 after a signal,
2 for a bad argument, 1 if the address cannot be bound.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import Optional, Sequence

from lighthouse import server

LOG_FORMAT = "%(asctime)s %(levelname)s [lighthouse] %(message)s"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser: one subcommand per action (``serve`` for now)."""
    parser = argparse.ArgumentParser(prog="ftbridge-lighthouse", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser("serve", help="run the lighthouse until SIGTERM/SIGINT")
    serve.add_argument("--bind", default=server.DEFAULT_BIND,
                       help="HOST:PORT to listen on; port 0 picks a free one (default %(default)s)")
    serve.add_argument("--min-replicas", type=int, default=server.DEFAULT_MIN_REPLICAS,
                       help="fewest replica groups that form a quorum (default %(default)s)")
    serve.add_argument("--join-timeout-ms", type=int, default=server.DEFAULT_JOIN_TIMEOUT_MS,
                       help="how long a quorum waits for heartbeating groups that have not joined, ms "
                            "(default %(default)s; torchft's 60000 stalls a job a minute on a straggler)")
    serve.add_argument("--heartbeat-timeout-ms", type=int, default=server.DEFAULT_HEARTBEAT_TIMEOUT_MS,
                       help="silence after which a replica group is dead, ms (default %(default)s)")
    serve.add_argument("--quorum-tick-ms", type=int, default=server.DEFAULT_QUORUM_TICK_MS,
                       help="how often a pending quorum is re-checked, ms (default %(default)s)")
    serve.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                       help="level of this program's log lines (default %(default)s)")
    serve.set_defaults(func=_serve)
    return parser


def _serve(args: argparse.Namespace) -> int:
    stop = threading.Event()
    received: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        received.append(signum)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
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
            print(f"ftbridge-lighthouse: serving on {service.address}", flush=True)
            while not stop.wait(1.0):  # a timed wait keeps signal handling prompt everywhere
                pass
            logging.getLogger("lighthouse").info(
                "shutting down signal=%s", signal.Signals(received[0]).name)
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


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
