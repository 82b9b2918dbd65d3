"""An Accelerate training loop that trains the same model whatever fails: slots.

A complete Accelerate script (a tiny GPT-2 built from a config, fixed-length token rows, ZeRO-2 from a
``DeepSpeedPlugin`` with 2 accumulation steps, a warm-up schedule). The job keeps 2 data-parallel slots;
each step, the live replica groups compute the micro-batches of any missing one too, so every committed
step trains on the rows of the failure-free run (plain DeepSpeed on 2 ranks), whichever groups are live.
What differs from plain Accelerate is marked ``# New Code #``: the accelerator's import, the slots, and a
loop over ``accelerator.units()`` that reads each unit's rows (``UnitSampler``) and draws its dropout
masks from the unit (``unit_rng``), not from the group that computes it. It runs on the CPU.

Run it as a whole local job (a lighthouse and 2 replica groups x 1 rank, on this machine)::

    python examples/hf_accelerate_slots.py

or by hand, each line in its own terminal::

    ftbridge-lighthouse serve --bind 127.0.0.1:29510
    ftbridge-run --replica-group-id 0 --num-replica-groups 2 --nproc-per-node 1 -- examples/hf_accelerate_slots.py
    ftbridge-run --replica-group-id 1 --num-replica-groups 2 --nproc-per-node 1 -- examples/hf_accelerate_slots.py

Started by hand, group 0 may train alone before group 1 arrives: it then computes both slots, and the run
is still the failure-free one. Each group prints its last step, loss and a checksum of its parameters
(equal checksums: one model). Docs: ``docs/huggingface.md``, "The same model whatever fails (slots)".
"""

from __future__ import annotations

import argparse
import os
import sys

########################################################################
# This is a fully working example of an Accelerate loop with slots under
# ftbridge: each replica group is its own torchrun world, launched with
# `ftbridge-run`, a step commits on every group or on none, and each
# committed step trains on the rows of the failure-free run.
#
# The changed lines are marked `# New Code #`.
########################################################################

GRADIENT_ACCUMULATION_STEPS = 2


def training_function(args: argparse.Namespace) -> None:
    """One rank of one replica group (started by ``ftbridge-run``)."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported (it picks it once)
    from accelerate import DeepSpeedPlugin
    from accelerate.utils import InitProcessGroupKwargs, set_seed
    from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

    from ftbridge.config import FTBridgeConfig
    from ftbridge.events import tensor_checksum

    # New Code #
    # The accelerator, under Accelerate's name, and the sampler of each unit's rows.
    from ftbridge.integrations.accelerate import FaultTolerantAccelerator as Accelerator
    from ftbridge.slots.data import UnitSampler, unit_rng

    plugin = DeepSpeedPlugin(hf_ds_config={"train_micro_batch_size_per_gpu": args.batch_size,
                                           "gradient_accumulation_steps": GRADIENT_ACCUMULATION_STEPS,
                                           "zero_optimization": {"stage": 2},
                                           "steps_per_print": 10**9})
    # New Code #
    # The job's slots: the data-parallel width of the failure-free run, in replica groups (FTBRIDGE_SLOTS,
    # or ftbridge-run --slots, set it for a launch; an argument wins over both).
    accelerator = Accelerator(deepspeed_plugin=plugin, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")],
                              ft_config=FTBridgeConfig.resolve(slots=args.slots))
    set_seed(args.seed)  # the same initial model in every replica group
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32))
    rows = torch.randint(0, 128, (args.rows, 32), generator=torch.Generator().manual_seed(7))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    steps = args.epochs * (args.rows // (args.batch_size * GRADIENT_ACCUMULATION_STEPS * args.slots))
    # A prepared scheduler steps once per rank of the failure-free run (here: per slot) each optimizer step.
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=10 * args.slots,
                                                num_training_steps=steps * args.slots)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    # New Code #
    # Rows by unit: plain DistributedSampler(drop_last=True) order over the slots' ranks, shuffled per epoch.
    sampler = UnitSampler.for_engine(model, len(rows), seed=args.seed)
    assert steps == args.epochs * sampler.steps_per_epoch

    model.train()
    loss = torch.zeros(())
    # New Code #
    # Loop on the engine's committed steps; each step's units are this group's micro-batches, then those
    # of any missing group. A discarded step is tried again, with the same units' rows.
    while model.global_steps < steps:
        for unit in accelerator.units():
            batch = rows[sampler.indices(unit)].to(accelerator.device)
            with unit_rng(unit, seed=args.seed):  # the unit's dropout masks, whichever group computes it
                loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()

    state = accelerator.get_state_dict(model)
    cfg = model.ftbridge.cfg
    print(f"[replica {cfg.replica_group_id} rank {cfg.group_rank}] step {int(model.global_steps)} "
          f"loss {float(loss):.4f} params {tensor_checksum(state.values())}", flush=True)
    accelerator.end_training()


def main() -> None:
    parser = argparse.ArgumentParser(description="An Accelerate loop with slots under ftbridge.")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--slots", type=int, default=2)
    training_function(parser.parse_args())


if __name__ == "__main__":
    if "RANK" in os.environ:  # started by ftbridge-run (torchrun)
        main()
    else:  # a whole local job: a lighthouse and 2 replica groups x 1 rank, each running this file
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from ftbridge.harness.local_job import run_script_locally

        sys.exit(run_script_locally(__file__))
