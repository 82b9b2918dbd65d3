"""A pool of long-lived worker processes (replica groups x group ranks) that run job after job.

Starting DeepSpeed costs seconds per process; a property test runs many small
jobs, so the processes start once per pool and run each drawn job in turn
(``workers/sync_worker.py``). Every wait has a deadline; a pool whose job
failed or timed out is stopped (processes killed by PID) and started afresh
for the next job, since its collectives no longer pair.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "integration", "workers", "sync_worker.py")


class JobFailed(AssertionError):
    """A worker answered with an error, died, or did not answer in time (holds the workers' output)."""


class SyncPool:
    """``groups`` replica groups of ``group_size`` ranks, each rank one worker process.

    Args:
        groups, group_size: the job shape every job run here must have.
        timeout_s: deadline for start-up and for each job, seconds.
    """

    def __init__(self, groups: int, group_size: int, timeout_s: float = 120.0) -> None:
        self.groups, self.group_size, self.timeout_s = groups, group_size, timeout_s
        self.procs: Dict[Tuple[int, int], subprocess.Popen] = {}
        self.logs: Dict[Tuple[int, int], List[str]] = {}
        self.dir: Optional[tempfile.TemporaryDirectory] = None
        self.lines: "queue.Queue[Tuple[Tuple[int, int], str]]" = queue.Queue()

    def start(self) -> None:
        """Start every worker and wait until each has joined both of its process groups."""
        self.stop()
        self.dir = tempfile.TemporaryDirectory(prefix="ftbridge-sync-pool-")
        env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=ROOT,
                   SYNC_GROUPS=str(self.groups), SYNC_STORE_DIR=self.dir.name,
                   SYNC_TIMEOUT_S=str(int(self.timeout_s)), WORLD_SIZE=str(self.group_size),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
        for g in range(self.groups):
            for r in range(self.group_size):
                self.procs[g, r] = subprocess.Popen(
                    [sys.executable, WORKER], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, text=True, bufsize=1,
                    env=dict(env, SYNC_GROUP=str(g), RANK=str(r), LOCAL_RANK=str(r)))
                self.logs[g, r] = []
                threading.Thread(target=self._pump, args=((g, r), self.procs[g, r]), daemon=True).start()
        self._replies("start-up")

    def _pump(self, key: Tuple[int, int], proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.lines.put((key, line))
        self.lines.put((key, ""))

    def run(self, spec_json: str) -> Tuple[List[str], List[dict]]:
        """Run one job on every worker.

        Returns:
            (paths of each replica group's parameters, safetensors; every worker's reply).

        Raises:
            JobFailed: with the failing workers' output; the pool is stopped.
        """
        if not self.procs:
            self.start()
        outs = [os.path.join(self.dir.name, f"params_{g}.safetensors") for g in range(self.groups)]
        for (g, _), p in self.procs.items():
            p.stdin.write(json.dumps({"spec": spec_json, "out": outs[g]}) + "\n")
            p.stdin.flush()
        return outs, self._replies("job")

    def _replies(self, what: str) -> List[dict]:
        replies: Dict[Tuple[int, int], dict] = {}
        deadline = time.monotonic() + self.timeout_s
        while len(replies) < len(self.procs):
            try:
                key, line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self._fail(f"{what}: no answer from {sorted(set(self.procs) - set(replies))} "
                           f"within {self.timeout_s:.0f} s")
            if not line:
                self._fail(f"{what}: worker {key} exited ({self.procs[key].wait()})")
            if line.startswith("@@"):
                replies[key] = json.loads(line[2:])
                if not replies[key]["ok"]:
                    self._fail(f"{what}: worker {key}: {replies[key]['error']}\n{replies[key].get('traceback', '')}")
            else:
                self.logs[key].append(line)
                del self.logs[key][:-60]
        return [replies[k] for k in sorted(replies)]

    def _fail(self, message: str) -> None:
        tails = "\n".join(f"--- worker {k} ---\n" + "".join(v[-25:]) for k, v in self.logs.items())
        self.stop()
        raise JobFailed(f"{message}\n{tails}")

    def stop(self) -> None:
        """Kill every worker by PID and remove the stores."""
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
            for f in (p.stdin, p.stdout):
                try:
                    f.close()
                except OSError:
                    pass
        self.procs = {}
        self.lines = queue.Queue()
        if self.dir is not None:
            self.dir.cleanup()
            self.dir = None
