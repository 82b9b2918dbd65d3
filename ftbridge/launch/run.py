"""``ftbridge-run``: launch one replica group as its own torchrun job.

Each replica group runs its own ``ftbridge-run`` and torchrun, so it has its own torch.distributed world and
rendezvous; the groups meet only through the lighthouse (``ftbridge-lighthouse serve``)::

    ftbridge-lighthouse serve --min-replicas 1 &
    ftbridge-run --replica-group-id 0 --num-replica-groups 2 --nproc-per-node 2 -- scripts/train_lm.py
    ftbridge-run --replica-group-id 1 --num-replica-groups 2 --nproc-per-node 2 -- scripts/train_lm.py

:func:`build_torchrun_command` lists the environment the ranks get. torchrun restarts the whole group when a rank
fails (``--max-restarts``, default 3), and the group heals from a peer. Signals are forwarded to torchrun and no
process is left behind (:mod:`ftbridge.launch.supervise`). Exit code: torchrun's (128+N if it died of signal N),
or 2 for a bad argument, found before anything starts. Spares: docs/spares.md; several nodes: docs/multi-node.md.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import shlex
import socket
import sys
import uuid
from datetime import timedelta
from typing import Callable, Mapping, Optional, Sequence
from urllib.parse import urlsplit

from ftbridge.config import FTBridgeConfig
from ftbridge.launch.build_lock import prepare_jit_build
from ftbridge.launch.cli_types import ArgumentParser
from ftbridge.launch.processes import (
    find_free_port,
    torchrun_command,
)
from ftbridge.launch.supervise import LAUNCH_ID_ENV, run_torchrun
from ftbridge.log import log_level

log = logging.getLogger("ftbridge.launch.run")

DEFAULT_LIGHTHOUSE = "http://127.0.0.1:29510"
"""Where ``ftbridge-lighthouse serve`` listens by default."""


# Flag given -> (environment variable set for the ranks, config field it feeds).
_OPTIONAL_SETTINGS = {
    "min_replicas": ("FTBRIDGE_MIN_REPLICAS", "min_replicas"),
    "slots": ("FTBRIDGE_SLOTS", "slots"),
    "cross_replica_timeout_s": ("FTBRIDGE_CROSS_REPLICA_TIMEOUT_S", "cross_replica_timeout"),
    "quorum_timeout_s": ("FTBRIDGE_QUORUM_TIMEOUT_S", "quorum_timeout"),
    "heartbeat_interval_ms": ("FTBRIDGE_HEARTBEAT_INTERVAL_MS", "heartbeat_interval"),
    "event_log": ("FTBRIDGE_EVENT_LOG", "event_log"),
    "comm_hook": ("FTBRIDGE_COMM_HOOK", "comm_hook"),
    "comm_wrapper": ("FTBRIDGE_COMM_WRAPPER", "comm_wrapper"),
    "comm_state_option": ("FTBRIDGE_COMM_STATE_OPTION", "comm_state_option"),
}


def build_parser() -> argparse.ArgumentParser:
    """The parser of the launcher's own flags (everything before ``--``)."""
    p = ArgumentParser(
        prog="ftbridge-run",
        usage="ftbridge-run (--replica-group-id I | --spare-index K) --num-replica-groups N --nproc-per-node M "
              "[options] -- SCRIPT [ARGS...]",
        description="Run one ftbridge replica group under torchrun (c10d rendezvous, restarts).",
    )
    g = p.add_argument_group("replica group")
    g.add_argument("--replica-group-id", type=int, default=None,
                   help="id of this group, 0..N-1 (or --spare-index)")
    g.add_argument("--spare-index", "--spare", dest="spare", type=int, default=None, metavar="K",
                   help="a warm spare with index K (0, 1, ...) instead of --replica-group-id (--spare K is the "
                        "same): it initialises "
                        "fully, stands by outside the quorum and takes over the id of the first replica group "
                        "the lighthouse drops (spare K acts K s after spare 0); see docs/spares.md")
    g.add_argument("--num-replica-groups", type=int, required=True, help="groups the job is planned for")
    g.add_argument("--nproc-per-node", type=int, required=True, help="ranks of this group per node")
    g.add_argument("--lighthouse", default=None,
                   help=f"torchft lighthouse address (default $FTBRIDGE_LIGHTHOUSE, $TORCHFT_LIGHTHOUSE "
                        f"or {DEFAULT_LIGHTHOUSE})")
    g.add_argument("--no-lighthouse-check", action="store_true",
                   help="do not check that the lighthouse answers before launching (it starts later)")
    g.add_argument("--max-restarts", type=int, default=3,
                   help="restarts of the whole group after a rank fails (default %(default)s)")
    g.add_argument("--shutdown-timeout-s", type=float, default=10.0,
                   help="seconds ranks get between SIGTERM and SIGKILL (default %(default)s)")
    f = p.add_argument_group("ftbridge settings (set as FTBRIDGE_* for the ranks when given)")
    f.add_argument("--min-replicas", type=int, help="fewest groups that may commit a step")
    f.add_argument("--slots", type=int, help="failure-transparent training: the job's data-parallel slots, "
                                             "usually --num-replica-groups (0: off); the script iterates "
                                             "engine.units() (docs/your-script.md)")
    f.add_argument("--cross-replica-timeout-s", type=float, help="bound on cross-group collectives, s")
    f.add_argument("--quorum-timeout-s", type=float, help="bound on one quorum request, s")
    f.add_argument("--heartbeat-interval-ms", type=float, help="manager heartbeat interval, ms")
    f.add_argument("--event-log", help="JSON-lines event log; {replica_group} and {group_rank} substituted")
    f.add_argument("--comm-hook", help="cross-replica communication hook: no, fp16, bf16, power_sgd, "
                                       "batched_power_sgd (docs/comm_hooks.md)")
    f.add_argument("--comm-wrapper", help="fp16 or bf16 cast around a PowerSGD hook")
    f.add_argument("--comm-state-option", metavar="JSON", help="PowerSGD options as a JSON object")
    f.add_argument("--job-token-file", metavar="PATH",
                   help="file holding the job's heal secret (FTBRIDGE_JOB_TOKEN, >= 16 characters; the same on "
                        "every group): donors then serve heal state only to ranks that know it")
    r = p.add_argument_group("torchrun rendezvous (one rendezvous per replica group)")
    r.add_argument("--nnodes", default="1", help="nodes of this group, N or MIN:MAX (default 1)")
    r.add_argument("--node-rank", type=int, default=0, help="this node's rank (static rendezvous)")
    r.add_argument("--rdzv-backend", default="c10d", help="default c10d; others restart unreliably")
    r.add_argument("--rdzv-endpoint", help="HOST[:PORT] of the group's rendezvous (default "
                                          "MASTER_ADDR:<free port>, one node only)")
    r.add_argument("--rdzv-id", help="rendezvous id (default ftbridge-group-I)")
    r.add_argument("--master-addr", default="127.0.0.1",
                   help="host of the default rendezvous endpoint (default %(default)s)")
    return p


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse ``FLAGS -- SCRIPT [ARGS...]`` into a namespace with ``script`` and ``script_args``; ``ValueError``
    without ``-- SCRIPT``, argparse's ``SystemExit`` for ``--help`` (0) or a bad flag (2)."""
    argv = list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = build_parser().parse_args(argv[:cut])
    script = argv[cut + 1:]
    if not script:
        raise ValueError(
            "missing '-- SCRIPT [ARGS...]': put the training script after '--', e.g. "
            "ftbridge-run --replica-group-id 0 --num-replica-groups 2 --nproc-per-node 2 -- train.py"
        )
    args.script, args.script_args = script[0], script[1:]
    return args


def _nnodes_range(nnodes: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)(?::(\d+))?", nnodes.strip())
    lo, hi = (int(m.group(1)), int(m.group(2) or m.group(1))) if m else (0, 0)
    if lo < 1 or hi < lo:
        raise ValueError(f"--nnodes={nnodes!r} is not N or MIN:MAX with 1 <= MIN <= MAX; use e.g. 1 or 2")
    return lo, hi


def check_lighthouse_url(url: str, source: str = "--lighthouse") -> str:
    """Return ``url`` if it is ``http(s)://HOST:PORT``; ``source`` (flag or variable) names it in the message.

    Raises:
        ValueError: naming the source, the URL and the fix.
    """
    fix = ("pass the address printed by 'ftbridge-lighthouse serve', e.g. "
           f"--lighthouse {DEFAULT_LIGHTHOUSE}")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise ValueError(f"{source}={url!r} has an invalid port; {fix}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None or port == 0 \
            or parts.path not in ("", "/") or parts.query:
        raise ValueError(f"{source}={url!r} is not http://HOST:PORT; {fix}")
    return url


def _resolve_lighthouse(args: argparse.Namespace, environ: Mapping[str, str]) -> str:
    """Flag, then ``FTBRIDGE_LIGHTHOUSE``, then ``TORCHFT_LIGHTHOUSE``, then the default."""
    for source, value in (("--lighthouse", args.lighthouse),
                          ("FTBRIDGE_LIGHTHOUSE", environ.get("FTBRIDGE_LIGHTHOUSE")),
                          ("TORCHFT_LIGHTHOUSE", environ.get("TORCHFT_LIGHTHOUSE"))):
        if value:
            return check_lighthouse_url(value, source)
    return DEFAULT_LIGHTHOUSE


def _check_group_args(args: argparse.Namespace) -> None:
    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ValueError(msg)

    need(args.num_replica_groups >= 1,
         f"--num-replica-groups={args.num_replica_groups} must be at least 1")
    spare = getattr(args, "spare", None)
    need((args.replica_group_id is None) != (spare is None),
         "give exactly one of --replica-group-id I (an active group) and --spare-index K (a warm spare); "
         f"got --replica-group-id={args.replica_group_id}, --spare-index={spare}")
    need(spare is None or spare >= 0, f"--spare-index={spare} is negative; number the spares 0, 1, ...")
    need(spare is not None or 0 <= args.replica_group_id < args.num_replica_groups,
         f"--replica-group-id={args.replica_group_id} is outside 0..{args.num_replica_groups - 1} "
         f"for --num-replica-groups={args.num_replica_groups}; number the groups 0, 1, ..., N-1")
    need(args.nproc_per_node >= 1,
         f"--nproc-per-node={args.nproc_per_node} must be at least 1 (ranks of this group on this node)")
    need(args.max_restarts >= 0,
         f"--max-restarts={args.max_restarts} is negative; use 0 to never restart the group")
    need(math.isfinite(args.shutdown_timeout_s) and args.shutdown_timeout_s > 0,
         f"--shutdown-timeout-s={args.shutdown_timeout_s} must be a positive number of seconds")
    need(args.node_rank >= 0, f"--node-rank={args.node_rank} is negative")
    need(os.path.isfile(args.script),
         f"script {args.script!r} after '--' is not a file (cwd {os.getcwd()}); "
         "give the path of the training script")
    if args.event_log is not None:
        try:
            args.event_log.format(replica_group=0, group_rank=0)
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(
                f"--event-log={args.event_log!r} has a bad placeholder ({exc}); only {{replica_group}} and "
                "{group_rank} are substituted, write other braces as {{ }}") from None


def _rendezvous(args: argparse.Namespace, pick_port: Callable[[], int]) -> tuple[str, str]:
    """``(endpoint, rdzv_id)`` for this group's own rendezvous."""
    _, max_nodes = _nnodes_range(args.nnodes)
    endpoint = args.rdzv_endpoint
    if endpoint is None:
        if max_nodes > 1:
            raise ValueError(
                f"--nnodes={args.nnodes} needs --rdzv-endpoint HOST:PORT reachable from every node of "
                f"{group_label(args)} (e.g. its first node and a free port); the default "
                "endpoint (a free port on this machine) only works for one node")
        endpoint = f"{args.master_addr}:{pick_port()}"
    else:
        host, _, port = endpoint.rpartition(":") if ":" in endpoint else (endpoint, "", "")
        if not host or (port and (not port.isdigit() or not 0 < int(port) < 65536)):
            raise ValueError(f"--rdzv-endpoint={endpoint!r} is not HOST[:PORT]; use e.g. node3:29400")
    if args.rdzv_backend != "c10d":
        log.warning("--rdzv-backend=%s: restarts of DeepSpeed groups failed 4/4 here with torchrun's default "
                    "rendezvous; c10d with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 recovered 3/3",
                    args.rdzv_backend)
    default_id = (f"ftbridge-spare-{args.spare}" if getattr(args, "spare", None) is not None
                  else f"ftbridge-group-{args.replica_group_id}")
    return endpoint, args.rdzv_id or default_id


def group_label(args: argparse.Namespace) -> str:
    """``replica group I`` or ``spare K``, for messages."""
    spare = getattr(args, "spare", None)
    return f"spare {spare}" if spare is not None else f"replica group {args.replica_group_id}"


TOKEN_ENV = "FTBRIDGE_JOB_TOKEN"
MAX_TOKEN_FILE_BYTES = 4096


def read_token_file(path: str) -> str:
    """The job token in ``path``: its first line, surrounding whitespace stripped (at most 4 KiB are read).

    Raises:
        ValueError: the file cannot be read, is not a regular file, or holds no token.
    """
    try:
        if not os.path.isfile(path):
            raise ValueError(f"--job-token-file={path!r} is not a regular file")
        with open(path, "rb") as f:
            raw = f.read(MAX_TOKEN_FILE_BYTES)
        token = raw.decode("utf-8").splitlines()[0].strip() if raw.strip() else ""
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--job-token-file={path!r} cannot be read: {e}") from None
    if not token:
        raise ValueError(f"--job-token-file={path!r} holds no token; write one, e.g. "
                         "python -c 'import secrets; print(secrets.token_hex(16))' > FILE")
    return token


def _fmt(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _check_config(args: argparse.Namespace, env: Mapping[str, str]) -> None:
    """Resolve ftbridge's config as rank 0 will, so its rules run now, not in every rank."""
    overrides = {field: getattr(args, flag) for flag, (_, field) in _OPTIONAL_SETTINGS.items()}
    ms = overrides["heartbeat_interval"]
    if ms is not None:
        if not (math.isfinite(ms) and ms > 0):
            raise ValueError(f"--heartbeat-interval-ms={ms} must be a positive number of milliseconds")
        overrides["heartbeat_interval"] = timedelta(milliseconds=ms)
    log_level(env.get("FTBRIDGE_LOG_LEVEL"))  # the ranks' logging starts after DeepSpeed's: check it now
    try:
        FTBridgeConfig.resolve(environ=env, group_rank=0, group_size=args.nproc_per_node, **overrides)
    except ValueError as exc:
        named = [f"--{flag.replace('_', '-')} or {var}" for flag, (var, field) in _OPTIONAL_SETTINGS.items()
                 if field in str(exc)]
        where = "; set by " + ", ".join(named) if named else ""
        raise ValueError(f"{exc}{where} (or inherited FTBRIDGE_*/TORCHFT_* environment)") from exc


def build_torchrun_command(
    args: argparse.Namespace,
    environ: Optional[Mapping[str, str]] = None,
    *,
    pick_port: Callable[[], int] = find_free_port,
    launch_id: Optional[str] = None,
) -> tuple[list[str], dict[str, str]]:
    """Check the arguments and build torchrun's argv and environment; starts nothing.

    Args:
        args: from :func:`parse_args`.
        environ: the environment to pass on; ``os.environ`` when ``None``.
        pick_port: a free port for the default rendezvous endpoint; ``launch_id``: random when ``None``.

    Returns:
        ``(argv, env)``: ``argv`` runs ``sys.executable -m torch.distributed.run``; ``env`` is ``environ`` plus
        ``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS``, ``TORCHFT_LIGHTHOUSE`` and their ``FTBRIDGE_*`` names (a
        spare's id is ``N + K``), ``FTBRIDGE_SPARE_INDEX`` (-1: active), each optional flag's ``FTBRIDGE_*``,
        ``FTBRIDGE_JOB_TOKEN``, ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, ``FTBRIDGE_LAUNCH_ID`` and
        :func:`ftbridge.launch.processes.torchrun_command`'s variables.

    Raises:
        ValueError: naming the bad value and the fix (nothing was started).
    """
    environ = dict(os.environ if environ is None else environ)
    _check_group_args(args)
    lighthouse = _resolve_lighthouse(args, environ)
    endpoint, rdzv_id = _rendezvous(args, pick_port)

    env = dict(environ)
    spare = getattr(args, "spare", None)
    # A spare's id until it takes over a group: N + K, outside 0..N-1 (docs/spares.md).
    group_id = args.replica_group_id if spare is None else args.num_replica_groups + spare
    env.update({
        "REPLICA_GROUP_ID": str(group_id),
        "FTBRIDGE_REPLICA_GROUP_ID": str(group_id),
        "FTBRIDGE_SPARE_INDEX": str(-1 if spare is None else spare),
        "NUM_REPLICA_GROUPS": str(args.num_replica_groups),
        "FTBRIDGE_NUM_REPLICA_GROUPS": str(args.num_replica_groups),
        "TORCHFT_LIGHTHOUSE": lighthouse,
        "FTBRIDGE_LIGHTHOUSE": lighthouse,
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(max(1, math.ceil(args.shutdown_timeout_s))),
        LAUNCH_ID_ENV: launch_id or uuid.uuid4().hex,
    })
    for flag, (var, _) in _OPTIONAL_SETTINGS.items():
        value = getattr(args, flag)
        if value is not None:
            env[var] = value if isinstance(value, str) else _fmt(value)
    if getattr(args, "job_token_file", None):
        env[TOKEN_ENV] = read_token_file(args.job_token_file)
    argv, env = torchrun_command(args.script, args.script_args, nproc_per_node=args.nproc_per_node,
                                 rdzv_endpoint=endpoint, rdzv_id=rdzv_id, rdzv_backend=args.rdzv_backend,
                                 nnodes=args.nnodes, node_rank=args.node_rank, max_restarts=args.max_restarts,
                                 environ=env)
    _check_config(args, env)
    return argv, env


def lighthouse_unreachable(url: str, timeout_s: float = 3.0) -> str:
    """``""`` if a TCP connection to the lighthouse at ``url`` opens within ``timeout_s``, else the reason."""
    parts = urlsplit(url)
    if parts.port is None:
        return f"no port in the lighthouse address {url!r}"
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=timeout_s):
            return ""
    except OSError as e:
        return str(e) or type(e).__name__


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``ftbridge-run``; returns the exit code (2: bad arguments)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    prepare_jit_build()  # the group's ranks inherit this environment's op cache and ninja
    try:
        args = parse_args(argv)
        torchrun_argv, env = build_torchrun_command(args)
    except SystemExit as exc:  # argparse: --help or a malformed flag
        return exc.code if isinstance(exc.code, int) else 2
    except ValueError as exc:
        print(f"ftbridge-run: error: {exc}", file=sys.stderr, flush=True)
        return 2
    if not args.no_lighthouse_check:
        problem = lighthouse_unreachable(env["TORCHFT_LIGHTHOUSE"])
        if problem:
            print(f"ftbridge-run: error: no lighthouse answers at {env['TORCHFT_LIGHTHOUSE']} ({problem}); start it "
                  "first (ftbridge-lighthouse serve --bind HOST:PORT), fix --lighthouse, or pass "
                  "--no-lighthouse-check if it starts later", file=sys.stderr, flush=True)
            return 2
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, datefmt="%Y-%m-%d %H:%M:%S",
                            format=f"%(asctime)s %(levelname)s [{group_label(args)} launcher] "
                                   "%(message)s")
    shown = {k: (env[k] if k != TOKEN_ENV else "<hidden>") for k in sorted(env) if env.get(k) != os.environ.get(k)}
    log.info("running: env %s %s", " ".join(f"{k}={shlex.quote(v)}" for k, v in shown.items()),
             shlex.join(torchrun_argv))
    return run_torchrun(torchrun_argv, env, shutdown_timeout_s=args.shutdown_timeout_s)


if __name__ == "__main__":
    sys.exit(main())
