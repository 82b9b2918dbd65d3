"""A whole ftbridge job on one machine: lighthouse plus K replica groups.

Used by the main demo (``scripts/demo.py``), the multi-process tests and,
later, the chaos and benchmark tools. Each replica group is one
``ftbridge-run`` (so one torchrun, its own world) started as a subprocess;
the lighthouse is torchft's real server, in this process. Every process is
tracked by PID and ended by :meth:`LocalJob.stop`; conditions are awaited by
reading the per-rank event logs (:mod:`ftbridge.events`), with a deadline.

Example::

    with LocalJob(workdir, num_groups=2, nproc_per_node=2, script_args=["--steps", "50"]) as job:
        job.start()
        job.wait_step(group=1, step=10, timeout_s=120)
        job.kill_workers(1)                 # torchrun restarts the group, which heals
        job.stop_lighthouse(); job.start_lighthouse()   # a lighthouse restart at the same address
        codes = job.wait(timeout_s=300)
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ftbridge.events import read_events
from ftbridge.harness.netfault import FaultProxy
from ftbridge.harness.netns import GroupHosts
from ftbridge.launch.processes import find_free_port, pid_alive, signal_pids, stop_process_groups, torchrun_command

logger = logging.getLogger(__name__)

REPO_SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts")
TRAIN_SCRIPT = os.path.join(REPO_SCRIPTS, "train_lm.py")


LIGHTHOUSE_CHILD = """
import sys
from lighthouse.server import start_lighthouse
lh = start_lighthouse(sys.argv[1], int(sys.argv[2]), join_timeout_ms=int(sys.argv[3]),
                      heartbeat_timeout_ms=int(sys.argv[4]))
print(lh.address, flush=True)
sys.stdin.read()  # until the job closes our stdin (or dies): then exit
lh.shutdown()
"""
"""The lighthouse in a process of its own: prints its address once it listens, serves until its stdin closes."""


@dataclass
class LighthouseProcess:
    """A lighthouse running in its own process (``LocalJob(lighthouse_process=True)``)."""

    proc: subprocess.Popen
    address: str

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def shutdown(self) -> None:
        """Kill it (continued first, if a test stopped it) and reap it."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


@dataclass
class GroupProcess:
    """One launch of one replica group."""

    group: int
    proc: subprocess.Popen
    log_path: str
    started: float = field(default_factory=time.time)
    relaunch: bool = False
    """This launch replaces one whose worker store lost its port (:meth:`LocalJob._relaunch_port_races`)."""
    exit_read: bool = False
    """Its exit was read for a lost port already (its logs are final once it exited: read once)."""


class LocalJob:
    """Lighthouse and replica groups on this machine, for demos and tests.

    Args:
        workdir: folder for event logs (``events_G_R.jsonl``) and group logs.
        num_groups: replica groups to run.
        nproc_per_node: ranks per replica group.
        script_args: arguments of the training script.
        script: training script (default ``scripts/train_lm.py``).
        min_replicas: fewest groups that may commit a step.
        lighthouse_min_replicas: the lighthouse's ``min_replicas`` (default
            ``min_replicas``); it applies to every quorum, so ``num_groups``
            makes all groups start together but stalls the job once one dies:
            use it only for runs without failures.
        max_restarts: torchrun restarts per group.
        heartbeat_timeout_ms, join_timeout_ms: lighthouse settings.
        env: extra environment for every group. ``FTBRIDGE_SLOTS`` is ``0`` (slots off, the library's
            default) unless set here or in this process's environment: ``scripts/train_lm.py`` alone would
            turn slots on, and the tests and benchmarks name the mode they measure.
        group_sizes: ranks of particular groups, ``{group: nproc}``, where they
            differ from ``nproc_per_node`` (to try a job whose groups do not
            match, which ftbridge must refuse).
        checksum_every: parameter checksum in the event log every N steps
            (``FTBRIDGE_CHECKSUM_EVERY``); default 1, so tests and chaos runs can
            compare replicas at every step. ``None``: the library default.
        lighthouse_process: run the lighthouse in a process of its own (:attr:`lighthouse_pid`), which a
            test can SIGSTOP (a hung lighthouse) or SIGKILL; default: in this process.
        proxies: each group reaches the lighthouse through a :class:`~ftbridge.harness.netfault.FaultProxy`
            of its own (:meth:`proxy`), whose link a test can blackhole or cut one way.
        hosts: each group runs on a host of its own (:class:`~ftbridge.harness.netns.GroupHosts`: a network
            namespace, made when the job starts), so a test can cut it off from its peers (:attr:`group_hosts`);
            needs root. Warm spares are not run this way.
    """

    def __init__(self, workdir: str, num_groups: int, nproc_per_node: int, script_args: Sequence[str], *,
                 script: str = TRAIN_SCRIPT, min_replicas: int = 1, lighthouse_min_replicas: Optional[int] = None,
                 max_restarts: int = 3, heartbeat_timeout_ms: int = 2000, join_timeout_ms: int = 1000,
                 env: Optional[Dict[str, str]] = None, checksum_every: Optional[int] = 1,
                 group_sizes: Optional[Dict[int, int]] = None, lighthouse_process: bool = False,
                 proxies: bool = False, hosts: bool = False) -> None:
        if num_groups < 1 or nproc_per_node < 1 or any(n < 1 for n in (group_sizes or {}).values()):
            raise ValueError(f"num_groups={num_groups}, nproc_per_node={nproc_per_node}, group_sizes={group_sizes}: "
                             "all must be >= 1")
        self.workdir = os.path.abspath(workdir)
        os.makedirs(self.workdir, exist_ok=True)
        self.num_groups = num_groups
        self.nproc = nproc_per_node
        self.group_sizes = {g: int(n) for g, n in (group_sizes or {}).items()}
        self.script = script
        self.script_args = list(script_args)
        self.min_replicas = min_replicas
        self.lighthouse_min_replicas = lighthouse_min_replicas or min_replicas
        self.max_restarts = max_restarts
        self.heartbeat_timeout_ms = heartbeat_timeout_ms
        self.join_timeout_ms = join_timeout_ms
        self.env = dict(env or {})
        if "FTBRIDGE_SLOTS" not in os.environ:
            self.env.setdefault("FTBRIDGE_SLOTS", "0")
        if checksum_every is not None:
            self.env.setdefault("FTBRIDGE_CHECKSUM_EVERY", str(checksum_every))
        self.lighthouse: Any = None
        self.lighthouse_process = lighthouse_process
        self._proxies: Optional[Dict[int, FaultProxy]] = {} if proxies else None
        self._want_hosts = hosts
        self.group_hosts: Optional[GroupHosts] = None
        """The groups' hosts (``hosts=True``, once the job started)."""
        self.groups: Dict[int, List[GroupProcess]] = {}
        self.spares: Dict[int, GroupProcess] = {}
        """Warm spares by index (``ftbridge-run --spare-index K``); one that joined trains as a group's id."""

    # -- lifecycle --------------------------------------------------------
    def start(self, groups: Optional[Sequence[int]] = None) -> None:
        """Start the lighthouse (once) and the given groups (default: all)."""
        if self._want_hosts and self.group_hosts is None:
            self.group_hosts = GroupHosts(self.num_groups)
        if self.lighthouse is None:
            self.start_lighthouse()
        for g in range(self.num_groups) if groups is None else groups:
            self.start_group(g)

    def start_lighthouse(self, timeout_s: float = 10.0) -> None:
        """Start the in-process lighthouse: on a free port the first time, then on the same one.

        After :meth:`stop_lighthouse` this restarts it at the same address (as an
        operator restarting the service would), with a fresh in-memory state:
        quorum ids start again at 0.

        Raises:
            RuntimeError: it is already running.
            OSError: the port stays taken for ``timeout_s`` (another process grabbed it).
        """
        if self.lighthouse is not None:
            raise RuntimeError(f"the lighthouse already runs at {self.lighthouse.address}")
        os.environ.setdefault("RUST_LOG", "warn")  # before torchft's Rust logger starts
        from lighthouse.server import start_lighthouse

        port = getattr(self, "_lighthouse_port", 0)
        deadline = time.monotonic() + timeout_s
        start = self._lighthouse_child if self.lighthouse_process else start_lighthouse
        while True:
            try:
                self.lighthouse = start(f"{self._lighthouse_host}:{port}", self.lighthouse_min_replicas,
                                        join_timeout_ms=self.join_timeout_ms,
                                        heartbeat_timeout_ms=self.heartbeat_timeout_ms)
                break
            except OSError:
                if port == 0 or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)  # the old socket may linger a moment; retry until the deadline
        self._lighthouse_port = self.lighthouse.port

    def _lighthouse_child(self, bind: str, min_replicas: int, *, join_timeout_ms: int,
                          heartbeat_timeout_ms: int) -> "LighthouseProcess":
        cmd = [sys.executable, "-c", LIGHTHOUSE_CHILD, bind, str(min_replicas), str(join_timeout_ms),
               str(heartbeat_timeout_ms)]
        log = open(os.path.join(self.workdir, "lighthouse.log"), "ab")
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                env={**os.environ, "RUST_LOG": "warn"}, start_new_session=True)
        log.close()
        line = proc.stdout.readline().decode().strip() if proc.stdout else ""  # its address, once it listens
        if not line.startswith("http://"):
            proc.kill()
            proc.wait(timeout=10)
            raise OSError(f"the lighthouse process did not start on {bind} (see {self.workdir}/lighthouse.log)")
        return LighthouseProcess(proc, line)

    @property
    def lighthouse_pid(self) -> int:
        """PID of the lighthouse's own process (``lighthouse_process=True``, while it runs).

        Raises:
            RuntimeError: the lighthouse runs in this process, or not at all.
        """
        if not isinstance(self.lighthouse, LighthouseProcess):
            raise RuntimeError("the lighthouse is not a process of its own (LocalJob(..., lighthouse_process=True))")
        return self.lighthouse.proc.pid

    def proxy(self, group: int) -> FaultProxy:
        """The fault proxy between replica group ``group`` and the lighthouse (``proxies=True``).

        Raises:
            RuntimeError: the job has no proxies.
        """
        if self._proxies is None:
            raise RuntimeError("the groups reach the lighthouse directly (LocalJob(..., proxies=True))")
        if group not in self._proxies:
            self._proxies[group] = FaultProxy((self._lighthouse_host, self._lighthouse_port),
                                              bind_host=self._lighthouse_host)
        return self._proxies[group]

    def stop_lighthouse(self) -> None:
        """Stop the lighthouse (the groups keep running and retry their quorums); idempotent."""
        if self.lighthouse is not None:
            self.lighthouse.shutdown()
            self.lighthouse = None

    def group_size(self, group: int) -> int:
        """Ranks of replica group ``group``."""
        return self.group_sizes.get(group, self.nproc)

    @property
    def lighthouse_address(self) -> str:
        """The lighthouse's address, also while it is stopped (a group may start during an outage)."""
        if self.lighthouse is not None:
            return self.lighthouse.address
        return f"http://{self._lighthouse_host}:{self._lighthouse_port}"

    @property
    def _lighthouse_host(self) -> str:
        return self.group_hosts.lighthouse_host if self.group_hosts is not None else "127.0.0.1"

    def address_for(self, group: int) -> str:
        """The lighthouse address replica group ``group`` dials: its proxy's, or the lighthouse's."""
        return self.proxy(group).address if self._proxies is not None and group >= 0 else self.lighthouse_address

    def event_log(self, group: int, rank: int) -> str:
        """Event log path of ``group``/``rank``."""
        return os.path.join(self.workdir, f"events_{group}_{rank}.jsonl")

    def start_group(self, group: int) -> GroupProcess:
        """Launch replica group ``group`` with ``ftbridge-run``."""
        n = len(self.groups.get(group, []))
        gp = self._launch(["--replica-group-id", str(group)], os.path.join(self.workdir, f"group_{group}.{n}.log"),
                          group)
        self.groups.setdefault(group, []).append(gp)
        return gp

    def start_spare(self, index: int = 0) -> GroupProcess:
        """Launch warm spare ``index`` (``ftbridge-run --spare-index index``, :mod:`ftbridge.spare`).

        It stands by until the lighthouse drops a group, then trains as that
        group (its event log is that group's). Same ``max_restarts`` as the groups.

        Raises:
            RuntimeError: spare ``index`` was started already.
        """
        if index in self.spares:
            raise RuntimeError(f"spare {index} already started (pid {self.spares[index].proc.pid})")
        if self._want_hosts:
            raise RuntimeError("warm spares do not run on hosts of their own (LocalJob(..., hosts=True))")
        gp = self._launch(["--spare-index", str(index)], os.path.join(self.workdir, f"spare_{index}.log"), -1)
        self.spares[index] = gp
        return gp

    def _launch(self, identity: List[str], log_path: str, group: int) -> GroupProcess:
        cmd = [sys.executable, "-m", "ftbridge.launch.run", *identity,
               "--num-replica-groups", str(self.num_groups),
               "--nproc-per-node", str(self.group_size(group) if group >= 0 else self.nproc),
               "--lighthouse", self.address_for(group), "--max-restarts", str(self.max_restarts),
               "--min-replicas", str(self.min_replicas),
               "--event-log", os.path.join(self.workdir, "events_{replica_group}_{group_rank}.jsonl"),
               *([] if self.lighthouse is not None else ["--no-lighthouse-check"]),  # started during an outage
               "--", self.script, *self.script_args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        if self.group_hosts is not None:
            if not 0 <= group < self.group_hosts.num_groups:
                raise ValueError(f"replica group {group} has no host: the job's hosts are groups "
                                 f"0..{self.group_hosts.num_groups - 1}")
            cmd = [*self.group_hosts.prefix(group), *cmd]
            env.update(self.group_hosts.env(group))
        log = open(log_path, "ab")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        return GroupProcess(group, proc, log_path)

    def wait(self, timeout_s: float, groups: Optional[Sequence[int]] = None) -> Dict[int, int]:
        """Wait for the latest launch of each group to exit.

        Returns:
            ``{group: exit code}``.

        Raises:
            TimeoutError: a group still runs after ``timeout_s`` (log tails included).
        """
        deadline = time.monotonic() + timeout_s
        codes = {}
        for g in (sorted(self.groups) if groups is None else groups):
            gp = self.groups[g][-1]
            try:
                codes[g] = gp.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"replica group {g} still running after {timeout_s} s\n{self.tails()}") from None
        return codes

    def spare_ready(self, index: int) -> bool:
        """Whether every rank of spare ``index`` stands by (``spare_ready`` events under id ``num_groups + index``)."""
        g = self.num_groups + index
        paths = [self.event_log(g, r) for r in range(self.nproc)]
        return all(any(e.get("event") == "spare_ready" for e in read_events([p])) for p in paths)

    def wait_spare(self, index: int, timeout_s: float) -> int:
        """Wait for spare ``index``'s launcher to exit; returns its exit code.

        Raises:
            TimeoutError: it still runs after ``timeout_s`` (log tails included).
        """
        try:
            return self.spares[index].proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"spare {index} still running after {timeout_s} s\n{self.tails()}") from None

    def stop_group(self, group: int, timeout_s: float = 30) -> Optional[int]:
        """Make replica group ``group`` leave for good: SIGTERM its launcher (torchrun ends its ranks).

        Returns:
            The launcher's exit code (``None``: still running 10 s after its SIGKILL).
        """
        gp = self.groups[group][-1]
        pids = list(self.worker_pids(group).values())
        code = stop_process_groups([gp.proc], grace_s=timeout_s)[0]
        self.wait_until(lambda: not any(pid_alive(p) for p in pids), timeout_s, f"ranks {pids} of group {group} to end")
        return code

    def stop(self) -> None:
        """End every process this job started (SIGTERM, then SIGKILL) and the lighthouse."""
        stop_process_groups([gp.proc for launches in self._launches() for gp in launches], grace_s=15)
        signal_pids([p for p in self.all_worker_pids() if pid_alive(p)], signal.SIGKILL)
        self.stop_lighthouse()
        for proxy in (self._proxies or {}).values():
            proxy.close()
        if self.group_hosts is not None:
            self.group_hosts.close()

    def _launches(self) -> List[List[GroupProcess]]:
        return [*self.groups.values(), *([gp] for gp in self.spares.values())]

    def __enter__(self) -> "LocalJob":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- observation ------------------------------------------------------
    def events(self, group: Optional[int] = None, rank: Optional[int] = None) -> List[Dict[str, Any]]:
        """Event records (sorted by time), optionally for one group/rank."""
        groups = range(self.num_groups) if group is None else [group]
        return read_events([self.event_log(g, r) for g in groups
                            for r in (range(self.group_size(g)) if rank is None else [rank])])

    def steps(self, group: int, rank: int = 0) -> List[Dict[str, Any]]:
        """Step records (no ``event`` key) of one rank."""
        return [e for e in self.events(group, rank) if "event" not in e]

    def wait_until(self, condition: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.1) -> None:
        """Poll ``condition`` (reads files) until true.

        Raises:
            TimeoutError: after ``timeout_s``, naming ``what`` and the group log tails.
        """
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}\n{self.tails()}")
            self._relaunch_port_races()
            time.sleep(poll_s)

    def _relaunch_port_races(self) -> None:
        """Launch a replica group again, once, whose launch exited before its first step because its worker store
        lost its port: torchrun picks a free port and frees it before rank 0 binds it, and on a busy machine
        another socket can take it first (``EADDRINUSE``). With ``max_restarts`` 0 nothing else would restart
        it, and the test would fail on the machine, not on ftbridge."""
        for g, launches in list(self.groups.items()):
            gp = launches[-1]
            if gp.relaunch or gp.exit_read or gp.proc.poll() in (None, 0):
                continue
            gp.exit_read = True
            if any(e["time"] >= gp.started for e in self.steps(g)):
                continue
            with open(gp.log_path, encoding="utf-8", errors="replace") as f:
                text = f.read()
            if "EADDRINUSE" not in text:
                continue
            logger.warning("replica group %d: its launch (pid %d) exited before its first step, its worker store's "
                           "port taken by another socket (EADDRINUSE); launching it again", g, gp.proc.pid)
            self.start_group(g).relaunch = True

    def healed_since(self, group: int, since: float) -> bool:
        """Whether replica group ``group`` (rank 0) healed after time ``since`` (seconds since the epoch)."""
        return any(e["healed"] and e["time"] > since for e in self.steps(group))

    def wait_heal(self, group: int, since: float, timeout_s: float, what: str = "") -> None:
        """Wait until replica group ``group`` heals after ``since`` (see :meth:`wait_until`)."""
        self.wait_until(lambda: self.healed_since(group, since), timeout_s,
                        what or f"replica group {group} to heal")

    def wait_step(self, group: int, step: int, timeout_s: float, since: float = 0.0) -> None:
        """Wait until ``group`` rank 0 has committed ``step`` (after wall time ``since``)."""
        self.wait_until(lambda: any(e["committed"] and e["step"] >= step and e["time"] >= since
                                    for e in self.steps(group)), timeout_s,
                        f"replica group {group} to commit step {step}")

    def worker_pids(self, group: int) -> Dict[int, int]:
        """PIDs of the current ranks of ``group``: per rank, the latest start event whose process still runs.

        Not simply the latest start: with warm spares, a restart of a group can join while the spare
        that holds its id is paused, find that spare in its quorum and leave, after its start event.
        A PID whose process started after its start event was written is left out: that rank ended
        and the number went to another process (pid_max is 32768 on these machines and every thread
        takes a number), which a kill must not reach.
        """
        pids = {}
        for r in range(self.group_size(group)):
            live = self.holding_pids(group, r)
            if live:
                pids[r] = live[-1]
        return pids

    def holding_pids(self, group: int, rank: int = 0) -> List[int]:
        """PIDs of every live process that started as ``rank`` of ``group``, oldest first.

        More than one while a spare took the id of a group that still runs (paused or cut off from the
        lighthouse past its heartbeat timeout) and before one of the two left
        (:class:`ftbridge.spare.DuplicateReplicaGroup`). PIDs reused by another process are left out, as in
        :meth:`worker_pids`.
        """
        starts = live_starts(self.events(group, rank), lambda p, t: started_by(p, t) and pid_alive(p))
        return [e["pid"] for e in starts.get((group, rank), [])]

    def spare_events(self) -> List[Dict[str, Any]]:
        """Records of every stand-by event log: launched spares (id ``N + index``) and demoted restarts.

        A torchrun restart of group ``G`` that finds its id held by a spare stands by as spare
        ``N + G`` (:func:`ftbridge.spare.demote_if_taken`), so its ``spare_ready`` records are
        under id ``2N + G``.
        """
        n = self.num_groups
        ids = sorted({n + k for k in self.spares} | {2 * n + g for g in range(n)})
        return read_events([self.event_log(i, r) for i in ids for r in range(self.nproc)])

    def all_worker_pids(self) -> List[int]:
        """Every rank PID ever recorded by this job (standing-by ranks of spares and demoted restarts included)."""
        return [e["pid"] for e in [*self.events(), *self.spare_events()]
                if e.get("event") in ("start", "spare_ready")]

    def launch_of(self, pid: int) -> Optional[GroupProcess]:
        """The launch (``ftbridge-run`` of a group or a spare) whose torchrun runs rank ``pid``, if any.

        Follows parent PIDs (rank -> torchrun -> launcher, Linux ``/proc``); ``None`` when
        ``pid`` is gone or belongs to no launch of this job.
        """
        launchers = {gp.proc.pid: gp for launches in self._launches() for gp in launches}
        for _ in range(4):
            if pid in launchers:
                return launchers[pid]
            parent = parent_pid(pid)
            if parent is None or parent <= 1:
                return None
            pid = parent
        return launchers.get(pid)

    def kill_workers(self, group: int, sig: int = signal.SIGKILL, timeout_s: float = 30) -> List[int]:
        """Send ``sig`` to every rank of ``group`` (its torchrun stays) and wait until they are gone.

        Returns:
            The PIDs killed.

        Raises:
            RuntimeError: the group has no recorded ranks.
            TimeoutError: a rank is still alive after ``timeout_s``.
        """
        pids = list(self.worker_pids(group).values())
        if not pids:
            raise RuntimeError(f"replica group {group} has no running ranks to kill")
        signal_pids(pids, sig)
        if sig == signal.SIGKILL:
            self.wait_until(lambda: not any(pid_alive(p) for p in pids), timeout_s, f"ranks {pids} to die")
        return pids

    def write_file(self, name: str, text: str) -> str:
        """Atomically create ``workdir/name`` holding ``text`` (stop and fault trigger files)."""
        path = os.path.join(self.workdir, name)
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
        return path

    def max_step(self) -> int:
        """Highest committed step of any rank so far.

        Reads only the end of each rank's event log (the last 64 KiB), so the answer is a few
        milliseconds old even when the logs are long and the machine is busy: a stop step computed
        from it (:meth:`stop_soon`) is still ahead of every group when they read it. A log whose end
        holds no committed step is read whole.
        """
        return max((s for g, r in self._ranks() for s, _ in _tail_commits(self.event_log(g, r))[-1:]), default=0)

    def stop_soon(self, margin: int = 3, lead_s: float = 1.0) -> int:
        """Make every group stop at one step still ahead of all of them (the ``stop`` file of ``--stop-file``).

        The target is :meth:`max_step` plus ``margin`` steps, or plus the steps the job commits in
        ``lead_s`` seconds at its recent rate if more: every group must read the file before it reaches
        the target, or one stops there while another, which read it a step later, trains on alone.

        Returns:
            The target step.
        """
        tails = [_tail_commits(self.event_log(g, r)) for g, r in self._ranks()]
        best = max((t[-1][0] for t in tails if t), default=0)
        rate = max((_rate(t) for t in tails), default=0.0)
        target = best + max(margin, math.ceil(rate * lead_s))
        self.write_file("stop", str(target))
        return target

    def _ranks(self) -> List[Tuple[int, int]]:
        return [(g, r) for g in range(self.num_groups) for r in range(self.group_size(g))]

    def log_text(self, group: int) -> str:
        """Everything the launches of ``group`` printed so far."""
        out = []
        for gp in self.groups.get(group, []):
            with open(gp.log_path, encoding="utf-8", errors="replace") as f:
                out.append(f.read())
        return "".join(out)

    def tails(self, lines: int = 25, notable: int = 40) -> str:
        """For failure messages: per group log, its last ``notable`` lines that tell of a failure anywhere in
        the run (:data:`NOTABLE`: restarts, exit codes, signals, faults, errors, tracebacks' last lines), then
        its last ``lines`` lines. A CI log keeps only what the test printed, so a rank that died early in a
        long run must show up here."""
        out = []
        for launches in self._launches():
            for gp in launches:
                try:
                    with open(gp.log_path, encoding="utf-8", errors="replace") as f:
                        text = f.readlines()
                except OSError:
                    text = []
                marks = [line for line in text[:-lines] if NOTABLE.search(line)][-notable:]
                out.append(f"--- {gp.log_path}: failures noted earlier ({len(marks)} lines) ---\n{''.join(marks)}"
                           f"--- {gp.log_path}: last {lines} lines ---\n{''.join(text[-lines:])}")
        return "\n".join(out)


def _rate(commits: List[Tuple[int, float]]) -> float:
    """Committed steps per second over ``commits`` (``(step, time)``, oldest first); 0 with fewer than 2."""
    if len(commits) < 2 or commits[-1][1] <= commits[0][1]:
        return 0.0
    return (commits[-1][0] - commits[0][0]) / (commits[-1][1] - commits[0][1])


def _tail_commits(path: str, tail_bytes: int = 65536) -> List[Tuple[int, float]]:
    """``(step, time)`` of the committed step records at the end of the event log ``path``, oldest first.

    Reads the last ``tail_bytes`` (a log whose end holds no commit is read whole); ``[]`` with no file.
    """
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - tail_bytes))
            chunk = f.read()
    except FileNotFoundError:
        return []
    lines = chunk.splitlines()[1:] if size > tail_bytes else chunk.splitlines()  # the first may be cut
    out = []
    for line in lines:
        try:
            e = json.loads(line)
        except ValueError:
            continue  # a line still being written
        if isinstance(e, dict) and "event" not in e and e.get("committed"):
            out.append((int(e["step"]), float(e.get("time", 0.0))))
    if not out and size > tail_bytes:
        out = [(int(e["step"]), float(e.get("time", 0.0))) for e in read_events([path])
               if "event" not in e and e.get("committed")]
    return out


def run_script_locally(script: str, groups: int = 2, nproc: int = 1, prefix: str = "[replica",
                       timeout_s: float = 300.0) -> int:
    """Run ``script`` as a whole job on this machine (a lighthouse and ``groups`` x ``nproc`` ranks, all
    groups required for a quorum) and print each group's last line starting with ``prefix``.

    What the examples do when started without ``ftbridge-run`` (``python examples/minimal.py``).

    Returns:
        0 when every group exited 0; else 1, after printing the exit codes and the log tails to stderr.
        A job still running after ``timeout_s`` is ended (every process, by PID) and counts as failed.
    """
    with tempfile.TemporaryDirectory(prefix="ftbridge_local_") as wd, \
            LocalJob(wd, groups, nproc, [], script=os.path.abspath(script), min_replicas=groups,
                     lighthouse_min_replicas=groups, env={"OMP_NUM_THREADS": "1"}) as job:
        job.start()
        try:
            codes: Dict[int, int] = job.wait(timeout_s=timeout_s)
        except TimeoutError as exc:
            print(exc, file=sys.stderr)
            return 1
        for g in range(groups):
            lines = [line for line in job.log_text(g).splitlines() if line.startswith(prefix)]
            print(lines[-1] if lines else f"replica group {g} printed nothing", flush=True)
        if codes != {g: 0 for g in range(groups)}:
            print(f"exit codes {codes}\n{job.tails()}", file=sys.stderr)
            return 1
    return 0


def live_starts(events: Sequence[Dict[str, Any]], running: Callable[[int, float], bool]
                ) -> Dict[Tuple[int, int], List[Dict[str, Any]]]:
    """The ``start`` records whose process still runs, per ``(replica group, group rank)``, oldest first (pure).

    More than one for a rank while a spare took the id of a group that still runs (paused or cut off from
    the lighthouse past its heartbeat timeout) and before one of the two left.

    Args:
        events: event records of the groups' logs (any order).
        running: ``running(pid, start_time)``: whether that process still runs and is the one that wrote the
            record (not a reused PID).
    """
    out: Dict[Tuple[int, int], List[Dict[str, Any]]] = {}
    for e in events:
        group, rank = e.get("replica_group"), e.get("group_rank")
        if e.get("event") == "start" and isinstance(group, int) and isinstance(rank, int) \
                and running(e["pid"], e["time"]):
            out.setdefault((group, rank), []).append(e)
    for starts in out.values():
        starts.sort(key=lambda e: e["time"])
    return out


def started_by(pid: int, when: float) -> bool:
    """Whether process ``pid`` exists and started no later than ``when`` (seconds since the epoch, Linux).

    ``/proc/<pid>/stat`` gives the start in clock ticks since boot; ``/proc/stat``'s ``btime`` the boot.
    One tick plus a second of slack covers the rounding of both.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/stat", "rb") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return False
    return boot + ticks / os.sysconf("SC_CLK_TCK") <= when + 1.0


def parent_pid(pid: int) -> Optional[int]:
    """Parent PID of ``pid`` from ``/proc/<pid>/stat`` (Linux), ``None`` when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


NOTABLE = re.compile(r"launcher\]|exitcode|[Ss]ignal|FAULT|ERROR|Error:|Exception|restarted|"
                     r"terminate called|Abort|Fatal|core dumped|Timed out|timed out")
"""Lines of a group log that :meth:`LocalJob.tails` keeps from the whole run."""


def run_plain_deepspeed(workdir: str, nproc: int, script_args: Sequence[str], timeout_s: float,
                        script: str = TRAIN_SCRIPT) -> str:
    """Run ``script --plain`` (plain DeepSpeed data parallel) under torchrun with ``nproc`` ranks.

    The baseline of the equivalence tests and benchmarks: one torch.distributed world, no ftbridge.

    Returns:
        Everything the run printed.

    Raises:
        RuntimeError: a non-zero exit or a run still going after ``timeout_s`` (torchrun is sent
            SIGTERM, which stops its ranks, then SIGKILL), with the end of the log.
    """
    port = find_free_port()
    cmd, env = torchrun_command(script, ["--plain", *script_args], nproc_per_node=nproc,
                                rdzv_endpoint=f"127.0.0.1:{port}", rdzv_id=f"plain{port}",
                                environ={**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"})
    log_path = os.path.join(workdir, f"plain_{port}.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code: Optional[int] = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop_process_groups([proc], grace_s=20, kill_wait_s=None)
            code = None
    with open(log_path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    if code != 0:
        what = f"timed out after {timeout_s} s" if code is None else f"failed ({code})"
        raise RuntimeError(f"plain DeepSpeed run {what}:\n{text[-4000:]}")
    return text
