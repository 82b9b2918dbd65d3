"""One rank of an Accelerate + DeepSpeed ZeRO training run, plain or fault-tolerant, for the equivalence test.

``--plain`` (under torchrun, one world of every rank): ``accelerate.Accelerator``. Otherwise (under
``ftbridge-run``, one world per replica group): ``FaultTolerantAccelerator`` and
``shard_across_replica_groups`` on the training loader, the three lines a user changes. Both train the
same seeded model on the same seeded, shuffled data (SGD with momentum, a warm-up ``LambdaLR``, no gradient
clipping, so a scale or schedule error shows in the parameters) and write ``OUT/result_<dp rank>.pt``:
the initial and final parameters, the learning rate after every optimizer step, the dataset rows each batch held, the
engine's class name, the keys of ``accelerator.get_state_dict(model)`` and of the unwrapped model.

Flags: ``--out DIR``, ``--epochs``, ``--stage`` (ZeRO), ``--gas`` (gradient accumulation steps),
``--no-shard`` (negative control: skip the re-sharding), ``--no-sync`` (negative control: no cross-replica
average), ``--save-state`` (after training, two
``save_state`` calls with ``total_limit=1``, then ``load_state()`` over parameters moved by 1), ``--resume DIR``
(``load_state(DIR)`` before training; with ``--epochs 0`` the result holds the loaded parameters).

``--slots``: the failure-transparent loop instead. Under ftbridge, ``for unit in accelerator.units()`` with
each unit's rows from ``UnitSampler.for_engine`` (the job sets ``FTBRIDGE_SLOTS``); plain, the units of its
own rank with the same sampler and ``accumulate``. Trains ``--steps`` optimizer steps, fewer once
``--stop-file`` names a step; the result's ``lrs`` then maps every committed step to its learning rate.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--plain", action="store_true")
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--gas", type=int, default=1)
    p.add_argument("--no-shard", action="store_true")
    p.add_argument("--save-state", action="store_true",
                   help="after training: save_state twice (total_limit 1) into OUT/project, then load_state()")
    p.add_argument("--resume", help="load_state(RESUME) right after prepare, before training")
    p.add_argument("--no-sync", action="store_true", help="the negative control: no cross-replica average")
    p.add_argument("--slots", action="store_true", help="the loop over units (see the module docstring)")
    p.add_argument("--steps", type=int, default=10**6, help="with --slots: optimizer steps to train")
    p.add_argument("--stop-file", help="with --slots: stop at the step this file names, once it exists")
    args = p.parse_args()

    import deepspeed
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, ProjectConfiguration, set_seed

    from ftbridge.integrations.accelerate import FaultTolerantAccelerator

    plugin = DeepSpeedPlugin(hf_ds_config={
        "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": args.gas, "gradient_clipping": 0.0,
        "zero_optimization": {"stage": args.stage, "stage3_gather_16bit_weights_on_model_save": True},
        "steps_per_print": 10**9})
    make = Accelerator if args.plain else FaultTolerantAccelerator
    if args.no_sync and not args.plain:  # the negative control: each group keeps its own gradient
        from ftbridge.harness.control_hooks import no_sync_hook
        make = functools.partial(FaultTolerantAccelerator, comm_hook=no_sync_hook)
    # On the CPU, Accelerate sets up a distributed state only with an explicit backend.
    accelerator = make(deepspeed_plugin=plugin, gradient_accumulation_steps=args.gas,
                       dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=1234),
                       kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")],
                       project_config=ProjectConfiguration(project_dir=os.path.join(args.out, "project"),
                                                           automatic_checkpoint_naming=True, total_limit=1))
    assert accelerator.num_processes == int(os.environ["WORLD_SIZE"]), accelerator.num_processes
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    initial = {n: q.detach().clone() for n, q in model.named_parameters()}
    g = torch.Generator().manual_seed(7)
    x, idx = torch.randn(41, 8, generator=g), torch.arange(41)
    y = x.sum(1, keepdim=True).sin()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y, idx), batch_size=3, shuffle=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 8))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    if not args.plain and not args.no_shard and not args.slots:
        loader = accelerator.shard_across_replica_groups(loader)
    if args.resume:
        accelerator.load_state(args.resume)

    lrs, rows, discarded = [], [], 0
    if args.slots:
        lrs = _train_units(args, accelerator, model, optimizer, scheduler, loader.dataset)
        args.epochs = 0
    for _ in range(args.epochs):
        for xb, yb, ib in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(xb), yb)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            rows.append(ib.tolist())
            if accelerator.sync_gradients:
                lrs.append(scheduler.get_last_lr()[0])
                discarded += int(accelerator.optimizer_step_was_skipped)

    if args.plain:
        dp_rank = accelerator.process_index
    else:
        cfg = model.ftbridge.cfg
        dp_rank = cfg.replica_group_id * cfg.group_size + cfg.group_rank
    unwrapped = accelerator.unwrap_model(model)
    state = accelerator.get_state_dict(model) or {}  # gathered under ZeRO-3, on each world's rank 0 only
    saved, reloaded = [], None
    if args.save_state:
        saved = []
        for _ in range(2):
            saved.append(accelerator.save_state())
            # Plain Accelerate's save_state returns before every rank has written its random states, and the
            # next one deletes the older folder (total_limit): without this wait, a rank can write into a
            # folder its main process just deleted.
            accelerator.wait_for_everyone()
        saved = [None if p is None else str(p) for p in saved]
        latest = os.path.join(args.out, "project", "checkpoints", "checkpoint_1", "manifest.json")
        deadline = time.monotonic() + 120  # the other groups read what replica group 0 writes
        while not args.plain and not os.path.exists(latest) and time.monotonic() < deadline:
            time.sleep(0.1)
        with torch.no_grad():
            for q in model.module.parameters():
                q.add_(1.0)  # a load that does nothing would leave this
        accelerator.load_state()
        after = accelerator.get_state_dict(model) or {}
        reloaded = all(torch.equal(after[n], q) for n, q in state.items())
    result = {
        "params": {n: q.detach().clone() for n, q in state.items()}, "initial": initial,
        "lrs": lrs, "rows": rows, "discarded": discarded, "global_steps": int(model.global_steps),
        "engine_type": f"{type(model).__module__}.{type(model).__qualname__}",
        "is_deepspeed_engine": type(model) is deepspeed.DeepSpeedEngine,
        "unwrapped_is_model": type(unwrapped) is torch.nn.Sequential,
        "state_dict_keys": sorted(state.keys()),
        "model_keys": sorted(unwrapped.state_dict().keys()),
        "saved": saved, "reloaded": reloaded,
    }
    os.makedirs(args.out, exist_ok=True)
    torch.save(result, os.path.join(args.out, f"result_{dp_rank}.pt"))
    accelerator.end_training()


def _train_units(args, accelerator, model, optimizer, scheduler, dataset):
    """The ``--slots`` loop; returns ``{committed step: learning rate after it}``."""
    import contextlib

    from ftbridge.slots import Unit
    from ftbridge.slots.data import UnitSampler

    if args.plain:
        world = accelerator.num_processes
        sampler = UnitSampler(len(dataset), 3, args.gas, world, seed=1234)
    else:
        sampler = UnitSampler.for_engine(model, len(dataset), seed=1234)

    def target():
        if args.stop_file and os.path.exists(args.stop_file):
            with open(args.stop_file, encoding="utf-8") as f:
                return min(args.steps, int(f.read()))
        return args.steps

    lrs = {}
    while model.global_steps < target():
        step = int(model.global_steps)
        if args.plain:
            units = [Unit(step=step, slot=accelerator.process_index, micro=m, group_rank=0, group_size=1,
                          slots=world) for m in range(args.gas)]
        else:
            units = accelerator.units()
        for unit in units:
            xb, yb, _ = (t.to(accelerator.device) for t in dataset[sampler.indices(unit)])
            with accelerator.accumulate(model) if args.plain else contextlib.nullcontext():
                loss = torch.nn.functional.mse_loss(model(xb), yb)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        if model.global_steps == step + 1:
            lrs[step + 1] = scheduler.get_last_lr()[0]
    return lrs


if __name__ == "__main__":
    main()
