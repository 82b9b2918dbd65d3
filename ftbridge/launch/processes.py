"""torchrun command lines and process groups: :func:`torchrun_command` builds one, :func:`stop_process_groups`
stops a started one (in a session of its own); the rest are ports and ``/proc`` reads under them.
Why the environment: docs/troubleshooting.md.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from typing import List, Mapping, Optional, Sequence, Tuple

TORCHRUN = (sys.executable, "-m", "torch.distributed.run")
"""How torchrun is run: the module of this interpreter, so a virtual environment needs no ``torchrun`` on PATH."""


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (another process may take it later)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ephemeral_port_range() -> Tuple[int, int]:
    """The ports the kernel hands out for ``bind(0)`` and outgoing connections (Linux; else 32768-60999)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split()[:2])
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def find_free_port_run(count: int, host: str = "0.0.0.0", seed: Optional[int] = None) -> int:
    """``P`` such that ports ``P .. P + count - 1`` are all free on ``host`` right now.

    Looks from 10000 up to :func:`ephemeral_port_range`: ports no ``bind(0)`` or outgoing connection takes.

    Raises:
        ValueError: ``count`` < 1.
        RuntimeError: no free run found in 500 tries.
    """
    if count < 1:
        raise ValueError(f"count={count}: ask for at least 1 port")
    rng = random.Random(seed)
    top = ephemeral_port_range()[0] - count
    for _ in range(500):
        first = rng.randrange(10000, max(10001, top))
        socks = []
        try:
            for port in range(first, first + count):
                s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
                socks.append(s)
                s.bind((host, port))
            return first
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports on {host} below the ephemeral range")


def _stat_fields(pid: int) -> List[bytes]:
    """The fields of ``/proc/PID/stat`` after the command name (the state first); ``OSError`` if none."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()


def cpu_seconds(pid: int) -> Optional[float]:
    """CPU time ``pid`` has used so far (user + system, seconds, all its threads); ``None`` once it is gone."""
    try:
        fields = _stat_fields(pid)
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return _stat_fields(pid)[0] != b"Z"
    except (OSError, IndexError):
        return True


def torchrun_command(
    script: str,
    script_args: Sequence[str] = (),
    *,
    nproc_per_node: int,
    rdzv_endpoint: Optional[str] = None,
    rdzv_id: Optional[str] = None,
    rdzv_backend: str = "c10d",
    nnodes: Optional[str] = None,
    node_rank: Optional[int] = None,
    max_restarts: Optional[int] = None,
    environ: Optional[Mapping[str, str]] = None,
) -> Tuple[List[str], dict[str, str]]:
    """torchrun's argv and environment for ``script script_args``; starts nothing.

    Args:
        script: the training script torchrun runs on every rank.
        script_args: its arguments.
        nproc_per_node: ranks on this node.
        rdzv_endpoint: ``HOST:PORT`` of the rendezvous; ``None``: a free port on 127.0.0.1 (one node), picked now.
        rdzv_id: the rendezvous id; ``None``: ``local<port>``.
        rdzv_backend: torchrun's ``--rdzv-backend``.
        nnodes, node_rank, max_restarts: torchrun's flags of those names, left out when ``None``.
        environ: the environment to pass on (default ``os.environ``); its values win over the defaults
            ``OMP_NUM_THREADS=1`` and ``RUST_LOG=warn``; ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` is always ``1``.

    Returns:
        ``(argv, env)``: ``argv`` starts with :data:`TORCHRUN`; ``env`` is a new dict.

    Raises:
        ValueError: ``nproc_per_node`` below 1 (nothing was started).
    """
    if nproc_per_node < 1:
        raise ValueError(f"nproc_per_node={nproc_per_node}: torchrun needs at least one rank per node")
    if rdzv_endpoint is None:
        port = find_free_port()
        rdzv_endpoint, rdzv_id = f"127.0.0.1:{port}", rdzv_id or f"local{port}"
    flags = [("--nnodes", nnodes), ("--nproc-per-node", nproc_per_node), ("--node-rank", node_rank),
             ("--rdzv-backend", rdzv_backend), ("--rdzv-endpoint", rdzv_endpoint), ("--rdzv-id", rdzv_id),
             ("--max-restarts", max_restarts)]
    argv = [*TORCHRUN, *(s for flag, value in flags if value is not None for s in (flag, str(value))),
            script, *script_args]
    env = dict(os.environ if environ is None else environ)
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if not env.get("OMP_NUM_THREADS"):
        env["OMP_NUM_THREADS"] = "1"
    env.setdefault("RUST_LOG", "warn")
    return argv, env


def signal_group(pgid: int, sig: int) -> None:
    """Send ``sig`` to process group ``pgid``; a group that is gone (or not ours) is no error."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def signal_pids(pids: Sequence[int], sig: int) -> None:
    """Send ``sig`` to each of ``pids`` (torchrun's ranks share its group); one gone (or not ours) is skipped."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop_process_groups(procs: Sequence[subprocess.Popen], grace_s: float,
                        kill_wait_s: Optional[float] = 10.0) -> List[Optional[int]]:
    """Stop processes that lead their own process group (``start_new_session=True``): SIGTERM, then SIGKILL.

    SIGKILL goes to the whole group of each one still running ``grace_s`` after; an exited one is only reaped.

    Args:
        procs: the group leaders.
        grace_s: time between SIGTERM and SIGKILL (s), shared by all of ``procs``.
        kill_wait_s: time to wait for each after SIGKILL (s); ``None``: until it exits.

    Returns:
        Each exit code (negative: the signal), ``None`` for one still running after ``kill_wait_s``.
    """
    for p in procs:
        if p.poll() is None:
            signal_group(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            signal_group(p.pid, signal.SIGKILL)
            try:
                p.wait(timeout=kill_wait_s)
            except subprocess.TimeoutExpired:
                pass
    return [p.returncode for p in procs]
