"""Worker for tests/integration/test_launcher_restart.py, run by torchrun under ftbridge-run.

Usage: restart_worker.py OUT_DIR MODE

Every rank writes ``pid-A-R`` (its PID, A = TORCHELASTIC_RESTART_COUNT, R = rank)
once the process group is up, then all-reduces ``(rank + 1) * (A + 1)``.

MODE ``restart``: on attempts 0 and 1, rank 1 writes ``killing-A-1`` and
SIGKILLs itself after the all-reduce (``survived-A-1`` would prove it did not
die); rank 0 waits in a barrier that fails or is ended by torchrun. On attempt
2 both ranks write ``result-2-R`` (the all-reduced value) and ``done-R``, and
exit 0.

MODE ``hang``: after the all-reduce each rank prints ``READY rank R pid P`` to
stdout and sleeps until it is killed. MODE ``stubborn``: the same, but the
rank ignores SIGTERM and SIGINT (only SIGKILL ends it).
"""

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

out, mode = Path(sys.argv[1]), sys.argv[2]
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.init_process_group("gloo")
rank = dist.get_rank()
(out / f"pid-{attempt}-{rank}").write_text(str(os.getpid()))
value = torch.tensor([float((rank + 1) * (attempt + 1))])
dist.all_reduce(value)

if mode in ("hang", "stubborn"):
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    # One write() of a short line is atomic on a pipe; print() may interleave with the other rank.
    os.write(1, f"READY rank {rank} pid {os.getpid()}\n".encode())
    while True:
        time.sleep(3600)

if attempt < 2:
    if rank == 1:
        (out / f"killing-{attempt}-1").write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
        (out / f"survived-{attempt}-1").write_text("SIGKILL did not kill me")
    dist.barrier()  # rank 0: fails when rank 1 dies, or torchrun ends it
    (out / f"rank0-passed-barrier-{attempt}").write_text("unexpected")
    sys.exit(3)

(out / f"result-{attempt}-{rank}").write_text(repr(value.item()))
dist.barrier()
(out / f"done-{rank}").write_text("ok")
dist.destroy_process_group()
