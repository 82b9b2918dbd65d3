"""An Accelerate training loop with DeepSpeed ZeRO, fault-tolerant across replica groups.

A complete Accelerate script (a tiny GPT-2 built from a config, fixed-length token rows, ZeRO-2 from a
``DeepSpeedPlugin``, a warm-up schedule). What differs from plain Accelerate is marked ``# New Code #``:
the accelerator's import, the re-sharding of the training loader across replica groups, and a loop on
the engine's committed steps that reads the rows of step ``global_steps`` (a step discarded everywhere is
trained again on the same rows; a restarted group that healed reads on where the others are). It runs on
the CPU.

Run it as a whole local job (a lighthouse and 2 replica groups x 1 rank, on this machine)::

    python examples/hf_accelerate.py

or by hand, each line in its own terminal (one ``ftbridge-run`` per group instead of ``accelerate launch``)::

    ftbridge-lighthouse serve --bind 127.0.0.1:29510
    ftbridge-run --replica-group-id 0 --num-replica-groups 2 --nproc-per-node 1 -- examples/hf_accelerate.py
    ftbridge-run --replica-group-id 1 --num-replica-groups 2 --nproc-per-node 1 -- examples/hf_accelerate.py

Each group prints its last step, loss, a checksum of its parameters (equal checksums: one model) and one of
its random state (equal: the groups draw the same dropout masks, a healed group included). What changes and
what is refused: ``docs/huggingface.md``.
"""

from __future__ import annotations

import argparse
import os
import sys

########################################################################
# This is a fully working example of an Accelerate loop under ftbridge:
# each replica group is its own torchrun world, launched with
# `ftbridge-run`, and a step commits on every group or on none.
#
# The changed lines are marked `# New Code #`; the launch replaces
# `accelerate launch` with one `ftbridge-run` per group.
########################################################################


def training_function(args: argparse.Namespace) -> None:
    """One rank of one replica group (started by ``ftbridge-run``)."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported (it picks it once)
    from accelerate import DeepSpeedPlugin
    from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, set_seed
    from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

    from ftbridge.events import tensor_checksum

    # New Code #
    # The accelerator, under Accelerate's name.
    from ftbridge.integrations.accelerate import FaultTolerantAccelerator as Accelerator

    plugin = DeepSpeedPlugin(hf_ds_config={"train_micro_batch_size_per_gpu": args.batch_size,
                                           "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 2},
                                           "steps_per_print": 10**9})
    accelerator = Accelerator(deepspeed_plugin=plugin,
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
                              kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    set_seed(args.seed)  # the same initial model and row order in every replica group
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32))
    rows = torch.randint(0, 128, (args.rows, 32), generator=torch.Generator().manual_seed(7))
    # The loader's own generator: each new iterator draws a seed from it, not from the global generator
    # that dropout draws from (a healed group starts a new iterator where the others go on).
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(rows), batch_size=args.batch_size,
                                         shuffle=True, generator=torch.Generator().manual_seed(args.seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # Counted as Accelerate's examples count: in batches of the loader before prepare.
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=10,
                                                num_training_steps=args.epochs * len(loader))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    # New Code #
    # Group G's rank R reads plain data-parallel rank G * group_size + R's rows.
    loader = accelerator.shard_across_replica_groups(loader)
    steps = args.epochs * len(loader)

    model.train()
    loss = torch.zeros(())
    # New Code #
    # Loop on the engine's committed steps, reading the rows of step global_steps: a discarded step is
    # trained again on the same rows, and a restarted group that healed reads on where the others are.
    while model.global_steps < steps:
        start = int(model.global_steps)
        loader.set_epoch(start // len(loader))
        for i, (batch,) in enumerate(accelerator.skip_first_batches(loader, start % len(loader))):
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            if model.global_steps != start + i + 1 or model.global_steps >= steps:
                break  # discarded, healed or done: read again from global_steps

    state = accelerator.get_state_dict(model)
    cfg = model.ftbridge.cfg
    print(f"[replica {cfg.replica_group_id} rank {cfg.group_rank}] step {int(model.global_steps)} "
          f"loss {float(loss):.4f} params {tensor_checksum(state.values())} "
          f"rng {tensor_checksum([torch.get_rng_state()])}", flush=True)
    accelerator.end_training()


def main() -> None:
    parser = argparse.ArgumentParser(description="An Accelerate loop under ftbridge.")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--seed", type=int, default=42)
    training_function(parser.parse_args())


if __name__ == "__main__":
    if "RANK" in os.environ:  # started by ftbridge-run (torchrun)
        main()
    else:  # a whole local job: a lighthouse and 2 replica groups x 1 rank, each running this file
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from ftbridge.harness.local_job import run_script_locally

        sys.exit(run_script_locally(__file__))
