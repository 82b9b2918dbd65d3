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

from ftbridge.harness import control_hooks, lm_job
from ftbridge.launch.build_lock import prepare_jit_build

# Before DeepSpeed is imported: it picks its accelerator (DS_ACCELERATOR) once, at import.
DEVICE = lm_job.choose_device(sys.argv[1:])

import deepspeed  # noqa: E402 - after choose_device, which sets DS_ACCELERATOR
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from tqdm import tqdm  # noqa: E402

import ftbridge  # noqa: E402
from ftbridge.config import FTBridgeConfig  # noqa: E402

IMPORTS_DONE = time.time()  # the heal benchmark's "process start" phase ends here


def main(argv: list[str] | None = None) -> int:
    args = lm_job.build_parser().parse_args(argv)
    prepare_jit_build()
    if args.plain:
        cfg = None
        deepspeed.init_distributed(dist_backend="nccl" if DEVICE.startswith("cuda") else "gloo")
        topo = lm_job.Topology(dist.get_rank(), dist.get_world_size(), 0, dist.get_rank())
        if args.plain_global_of:
            if dist.get_world_size() != 1:
                raise SystemExit("--plain-global-of needs a world of one rank (torchrun --nproc-per-node 1)")
            topo = lm_job.Topology(0, args.plain_global_of, 0, 0, whole_batch=True)
    else:
        cfg = FTBridgeConfig.resolve(event_log=args.event_log, sync_mode=args.sync_mode, comm_hook=args.comm_hook,
                                     comm_wrapper=args.comm_wrapper, comm_state_option=args.comm_state_option)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    data, model = lm_job.build_data_and_model(args)
    if DEVICE != "cpu":
        torch.cuda.set_device(torch.device(DEVICE))
        model = model.to(DEVICE)
    optimizer = lm_job.build_optimizer(args, model)
    if args.plain:
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=lm_job.ds_config(args))
    else:
        engine, *_ = ftbridge.initialize(model=model, optimizer=optimizer, config=lm_job.ds_config(args),
                                         ft_config=cfg, comm_hook=control_hooks.from_args(args))
        engine.sync.order.timing = args.time_cross_replica_wait
        topo = lm_job.topology(engine.cfg)  # after initialize: a warm spare has taken a dead group's id
    plain = lm_job.PlainRun(engine, args, topo) if args.plain else None
    lm_job.write_start_phases(plain.events if plain else engine.events, IMPORTS_DONE)
    if plain:
        plain.resume()
    ckpt = None
    if cfg and args.checkpoint_dir:
        from ftbridge.checkpoint.checkpointer import Checkpointer, config_from_args

        ckpt = Checkpointer(engine, config_from_args(args))
        if args.resume and ckpt.resume() is not None:
            engine.events.write(event="resumed", time=lm_job.now(), step=int(engine.global_steps),
                                **lm_job.final_digest(engine, engine.adapter))
    bar = tqdm(total=args.steps, disable=not (args.progress and topo.group_rank == 0), unit="step",
               desc=f"replica {topo.replica_group}")
    val_loss = None
    step_times = []
    while engine.global_steps < lm_job.target_steps(args) and not (ckpt and ckpt.stopping):
        before = int(engine.global_steps)
        t = lm_job.now()
        loss = lm_job.train_step(engine, data, topo, args.grad_accum,
                                 engine.events if cfg and args.log_batches else None, args.seed)
        step_times.append(lm_job.now() - t)
        if plain:
            plain.after_step(step_times[-1], loss)
        bar.update(int(engine.global_steps) - before)
        participants = engine.manager.participants if cfg else topo.dp_world_size
        bar.set_postfix(loss=f"{loss:.3f}", participants=participants)
        if args.val_every and engine.global_steps % args.val_every == 0 and engine.global_steps > before:
            val_loss = lm_job.validate(engine, data, args.val_batches, args.micro_batch)
            if cfg:
                engine.events.write(event="validation", time=lm_job.now(), step=int(engine.global_steps),
                                    val_loss=val_loss)
            if topo.group_rank == 0:
                print(f"[replica {topo.replica_group}] step {engine.global_steps} val_loss {val_loss:.4f}",
                      flush=True)
    bar.close()
    if val_loss is None or engine.global_steps % max(args.val_every, 1) != 0:
        val_loss = lm_job.validate(engine, data, args.val_batches, args.micro_batch)
    from ftbridge.zero.stages import adapter_for

    adapter = engine.adapter if cfg else adapter_for(engine)
    digest = lm_job.final_digest(engine, adapter)
    fields = {"replica_group": topo.replica_group, "group_rank": topo.group_rank, "dp_rank": topo.dp_rank}
    lm_job.save_params(args.save_params if topo.group_rank == 0 else None, engine, adapter, fields)
    heals = engine.manager.heals if cfg else 0
    print(f"FINAL replica {topo.replica_group} rank {topo.group_rank} step {engine.global_steps} "
          f"val_loss {val_loss:.4f} param_checksum {digest['params']} heals {heals}", flush=True)
    if cfg:
        engine.events.write(event="final", time=lm_job.now(), step=int(engine.global_steps), val_loss=val_loss,
                            param_checksum=digest["params"], optimizer_checksum=digest["optimizer"],
                            lr=digest["lr"], scheduler_step=digest["scheduler_step"], heals=heals,
                            cross_replica_allreduces=engine.sync.allreduces,
                            cross_replica_bytes=engine.sync.bytes_sent,
                            cross_replica_messages_in_backward=engine.sync.issued_in_backward,
                            cross_replica_wait_s=engine.cross_replica_wait_s, guard_checks=engine.guard.checks,
                            cross_replica_exposed_wait_s=engine.sync.order.exposed_wait_s(),
                            cross_replica_backend=getattr(engine.manager, "backend", None), device=str(engine.device),
                            guard_mismatches=engine.guard.mismatches, guard_s=engine.guard.seconds,
                            protocol_s=getattr(engine.manager, "protocol_s", 0.0),
                            protocol_steps=getattr(engine.manager, "protocol_steps", 0),
                            lighthouse_probes=getattr(getattr(getattr(engine.manager, "outage", None), "_monitor",
                                                              None), "probes", 0),
                            reconfigure_votes_skipped=getattr(getattr(engine.manager, "quorum_guard", None),
                                                              "votes_skipped", 0),
                            **engine.sync.hook_state.describe())
    lm_job.write_result(args.result, {**digest, **fields, "val_loss": val_loss, "heals": heals,
                                      "step_times_s": step_times, "peak_rss_bytes": lm_job.peak_rss_bytes()})
    if ckpt:
        ckpt.close()
    if cfg:
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
