"""The baseline of the main job: plain DeepSpeed data parallelism over the whole torchrun world, no ftbridge.

``scripts/train_lm.py --plain`` runs :func:`run`; the equivalence tests, the benchmarks and the device
check compare ftbridge against it. It trains the same model on the same global batch per step as an
ftbridge job of ``world_size`` replica groups of one rank (or, with ``--plain-global-of N`` on one rank,
on the whole batch of an N-rank world), and writes the same ``FINAL`` line, step records and
``--result`` record::

    torchrun --standalone --nproc-per-node 4 scripts/train_lm.py --plain --steps 200
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from ftbridge.harness import lm_job


def run(args: argparse.Namespace, device: str, imports_done: float) -> int:
    """Train ``args`` with plain DeepSpeed on ``device`` (``cpu`` or ``cuda:R``); returns the exit code 0.

    ``imports_done``: when the process finished its imports (seconds since the epoch), for the restart
    benchmark's phases.

    Raises:
        SystemExit: ``--plain-global-of`` with a world of more than one rank.
    """
    import deepspeed
    import torch
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="nccl" if device.startswith("cuda") else "gloo")
    topo = lm_job.Topology(dist.get_rank(), dist.get_world_size(), 0, dist.get_rank())
    if args.plain_global_of:
        if dist.get_world_size() != 1:
            raise SystemExit("--plain-global-of needs a world of one rank (torchrun --nproc-per-node 1)")
        topo = lm_job.Topology(0, args.plain_global_of, 0, 0, whole_batch=True)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    data, model = lm_job.build_data_and_model(args)
    if device != "cpu":
        torch.cuda.set_device(torch.device(device))
        model = model.to(device)
    engine, *_ = deepspeed.initialize(model=model, optimizer=lm_job.build_optimizer(args, model),
                                      config=lm_job.ds_config(args))
    plain = PlainRun(engine, args, topo)
    lm_job.write_start_phases(plain.events, imports_done)
    plain.resume()
    val_loss, step_times = None, []
    while engine.global_steps < lm_job.target_steps(args):
        before = int(engine.global_steps)
        t = lm_job.now()
        loss = lm_job.train_step(engine, data, topo, args.grad_accum, None, args.seed)
        step_times.append(lm_job.now() - t)
        plain.after_step(step_times[-1], loss)
        if args.val_every and engine.global_steps % args.val_every == 0 and engine.global_steps > before:
            val_loss = lm_job.validate(engine, data, args.val_batches, args.micro_batch)
            if topo.group_rank == 0:
                print(f"[replica {topo.replica_group}] step {engine.global_steps} val_loss {val_loss:.4f}", flush=True)
    if val_loss is None or engine.global_steps % max(args.val_every, 1) != 0:
        val_loss = lm_job.validate(engine, data, args.val_batches, args.micro_batch)
    from ftbridge.zero.stages import adapter_for

    lm_job.finish(engine, adapter_for(engine), args, topo, val_loss, step_times, heals=0)
    return 0


class PlainRun:
    """Event log and DeepSpeed checkpoints of the ``--plain`` baseline (no ftbridge).

    The restart benchmark (:mod:`ftbridge.harness.bench.restart`) runs the plain job
    under torchrun ``--max-restarts``: it reads the same step records as an
    ftbridge job (``committed`` always true, ``participants`` the world size)
    and, with ``--checkpoint-dir``, the job saves with DeepSpeed's
    ``save_checkpoint`` every ``--checkpoint-every`` steps and, with
    ``--resume``, loads the latest one on start.
    """

    def __init__(self, engine: Any, args: argparse.Namespace, topo: lm_job.Topology) -> None:
        from ftbridge.events import EventLog

        self.engine, self.args, self.topo = engine, args, topo
        path = args.event_log or os.environ.get("FTBRIDGE_EVENT_LOG")
        self.events = EventLog(path.format(replica_group=0, group_rank=topo.group_rank) if path else None,
                               {"replica_group": 0, "group_rank": topo.group_rank})
        self.events.write(event="start", time=lm_job.now(), step=int(engine.global_steps), pid=os.getpid(),
                          attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))

    def resume(self) -> None:
        """Load the latest DeepSpeed checkpoint of ``--checkpoint-dir`` if ``--resume`` and one exists.

        Files are read with ``weights_only=True`` and ftbridge's allowlist
        (:func:`ftbridge.checkpoint.safe_load.load_deepspeed_checkpoint`).

        Raises:
            UnsafeCheckpointError: a file needs a type outside the allowlist;
                nothing was loaded.
        """
        from ftbridge.checkpoint.safe_load import load_deepspeed_checkpoint

        d = self.args.checkpoint_dir
        if not (d and self.args.resume and os.path.exists(os.path.join(d, "latest"))):
            return
        t = time.perf_counter()
        path, _ = load_deepspeed_checkpoint(self.engine, d)
        self.events.write(event="checkpoint_loaded", time=lm_job.now(), step=int(self.engine.global_steps), path=path,
                          load_s=time.perf_counter() - t)

    def after_step(self, step_time_s: float, loss: float) -> None:
        """Write the step record; save a checkpoint when the step is on the ``--checkpoint-every`` schedule."""
        step = int(self.engine.global_steps)
        self.events.write(time=lm_job.now(), step=step, participants=self.topo.dp_world_size, committed=True,
                          healed=False, loss=loss, step_time_s=step_time_s)
        every = self.args.checkpoint_every
        if self.args.checkpoint_dir and every and step % every == 0:
            t = time.perf_counter()
            self.engine.save_checkpoint(self.args.checkpoint_dir)
            self.events.write(event="checkpoint_saved", time=lm_job.now(), step=step, stall_s=time.perf_counter() - t)
