"""Train a character-level GPT on Shakespeare with DeepSpeed ZeRO, fault tolerant.

One replica group per launch; start a lighthouse first::

    ftbridge-lighthouse serve --bind 127.0.0.1:29510 &
    ftbridge-run --replica-group-id 0 --num-replica-groups 2 --nproc-per-node 2 -- scripts/train_lm.py --steps 200
    ftbridge-run --replica-group-id 1 --num-replica-groups 2 --nproc-per-node 2 -- scripts/train_lm.py --steps 200

``--device auto`` (the default) trains on this rank's GPU (``cuda:LOCAL_RANK``) when
CUDA is available, else on the CPU; ``--device cuda`` fails at once without a GPU
(see docs/gpu.md for several groups on one GPU).

Baseline (plain DeepSpeed data parallel over 4 ranks, no ftbridge)::

    torchrun --standalone --nproc-per-node 4 scripts/train_lm.py --plain --steps 200
"""

from __future__ import annotations

import os
import sys
import time

from ftbridge.harness import control_hooks, lm_job, plain_job
from ftbridge.launch.build_lock import prepare_jit_build

# Before DeepSpeed is imported: it picks its accelerator (DS_ACCELERATOR) once, at import.
DEVICE = lm_job.choose_device(sys.argv[1:])

import torch  # noqa: E402 - after choose_device, which sets DS_ACCELERATOR for DeepSpeed
from tqdm import tqdm  # noqa: E402

import ftbridge  # noqa: E402

IMPORTS_DONE = time.time()  # the heal benchmark's "process start" phase ends here


def main(argv: list[str] | None = None) -> int:
    args = lm_job.build_parser().parse_args(argv)
    prepare_jit_build()
    if args.plain:  # the baseline the tests and benchmarks compare against: plain DeepSpeed, no ftbridge
        return plain_job.run(args, DEVICE, IMPORTS_DONE)
    cfg = lm_job.ft_config(args)  # slots on (one per group) unless FTBRIDGE_SLOTS says otherwise
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    data, model = lm_job.build_data_and_model(args)
    if DEVICE != "cpu":
        torch.cuda.set_device(torch.device(DEVICE))
        model = model.to(DEVICE)
    optimizer = lm_job.build_optimizer(args, model)
    engine, *_ = ftbridge.initialize(model=model, optimizer=optimizer, config=lm_job.ds_config(args),
                                     ft_config=cfg, comm_hook=control_hooks.from_args(args))
    engine.sync.order.timing = args.time_cross_replica_wait
    topo = lm_job.topology(engine.cfg)  # after initialize: a warm spare has taken a dead group's id
    lm_job.write_start_phases(engine.events, IMPORTS_DONE)
    ckpt = lm_job.open_checkpointer(engine, args)  # None without --checkpoint-dir
    bar = tqdm(total=args.steps, disable=not (args.progress and topo.group_rank == 0), unit="step",
               desc=f"replica {topo.replica_group}")
    val_loss, step_times = None, []
    while engine.global_steps < lm_job.target_steps(args) and not (ckpt and ckpt.stopping):
        before = int(engine.global_steps)
        t = lm_job.now()
        loss = lm_job.train_step(engine, data, topo, args.grad_accum, engine.events if args.log_batches else None,
                                 args.seed)
        step_times.append(lm_job.now() - t)
        bar.update(int(engine.global_steps) - before)
        bar.set_postfix(loss=f"{loss:.3f}", participants=engine.manager.participants)
        if args.val_every and engine.global_steps % args.val_every == 0 and engine.global_steps > before:
            val_loss = lm_job.validate(engine, data, args.val_batches, args.micro_batch)
            engine.events.write(event="validation", time=lm_job.now(), step=int(engine.global_steps),
                                val_loss=val_loss)
            if topo.group_rank == 0:
                print(f"[replica {topo.replica_group}] step {engine.global_steps} val_loss {val_loss:.4f}",
                      flush=True)
    bar.close()
    if val_loss is None or engine.global_steps % max(args.val_every, 1) != 0:
        val_loss = lm_job.validate(engine, data, args.val_batches, args.micro_batch)
    lm_job.finish(engine, engine.adapter, args, topo, val_loss, step_times, engine.manager.heals, engine.events)
    if ckpt:
        ckpt.close()
    engine.shutdown()
    return 0


if __name__ == "__main__":
    code = main()
    # Everything is written and closed by now. DeepSpeed's ZeRO-3 with overlap_comm leaves a native
    # thread that aborts interpreter shutdown on CPU ("terminate called without an active exception",
    # exit -6, seen with plain DeepSpeed too), so leave without running finalizers.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
