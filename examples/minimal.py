"""The smallest complete ftbridge training script: copy it, then replace the model, the data and the loss.

Run it as a whole local job (a lighthouse and 2 replica groups x 1 rank, on this machine)::

    python examples/minimal.py             # STEPS=2000 python examples/minimal.py for a longer run

or by hand, each line in its own terminal (the way a real job starts, one ``ftbridge-run`` per group)::

    ftbridge-lighthouse serve --bind 127.0.0.1:29510
    ftbridge-run --replica-group-id 0 --num-replica-groups 2 --nproc-per-node 1 -- examples/minimal.py
    ftbridge-run --replica-group-id 1 --num-replica-groups 2 --nproc-per-node 1 -- examples/minimal.py

Kill one ``ftbridge-run`` while the other trains and start it again: it heals from the survivor and both
end with the same model. What each line is for: ``docs/your-script.md``.
"""

from __future__ import annotations

import os
import sys

STEPS = int(os.environ.get("STEPS", "60"))
MICRO_BATCH = 16


def batch(step: int, dp_rank: int):
    """The micro-batch of optimizer step ``step`` on data-parallel rank ``dp_rank``: a pure function of both,
    so a discarded step is retried on the same data and a healed group resumes where its peers are."""
    import torch

    g = torch.Generator().manual_seed(step * 100_003 + dp_rank)
    x = torch.randn(MICRO_BATCH, 32, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def train() -> None:
    """One rank of one replica group (started by ``ftbridge-run``)."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported (it picks it once)
    import ftbridge

    torch.manual_seed(0)  # the same initial model in every replica group
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    ds_config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
                 "zero_optimization": {"stage": 2}, "steps_per_print": 10**9}
    engine, _, _, _ = ftbridge.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                          config=ds_config)
    cfg = engine.cfg
    dp_rank = cfg.replica_group_id * cfg.group_size + cfg.group_rank
    loss = torch.zeros(())
    while engine.global_steps < STEPS:  # a discarded step does not advance it: loop on it, not on a count
        x, y = batch(engine.global_steps, dp_rank)
        loss = torch.nn.functional.mse_loss(engine(x.to(engine.device)), y.to(engine.device))
        engine.backward(loss)
        engine.step()  # commits on every replica group, or discards on every one
    from ftbridge.events import tensor_checksum  # SHA-256 of the parameters: the same on every replica group

    print(f"[replica {cfg.replica_group_id} rank {cfg.group_rank}] step {engine.global_steps} "
          f"loss {loss.item():.4f} params {tensor_checksum(model.parameters())}", flush=True)
    engine.shutdown()


if __name__ == "__main__":
    if "RANK" in os.environ:  # started by ftbridge-run (torchrun)
        train()
    else:  # a whole local job: a lighthouse and 2 replica groups x 1 rank, each running this file
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from ftbridge.harness.local_job import run_script_locally

        sys.exit(run_script_locally(__file__))
