"""A Transformers ``Trainer`` script with DeepSpeed ZeRO, fault-tolerant across replica groups.

A complete Trainer script (a tiny GPT-2 built from a config, fixed-length token rows, ZeRO-2 from
``TrainingArguments(deepspeed=...)``) in which one line differs from the plain Trainer's: the import marked
``# New Code #``. It runs on the CPU.

Run it as a whole local job (a lighthouse and 2 replica groups x 1 rank, on this machine)::

    python examples/hf_trainer.py

or by hand, each line in its own terminal (one ``ftbridge-run`` per group instead of ``torchrun`` or
``accelerate launch``)::

    ftbridge-lighthouse serve --bind 127.0.0.1:29510
    ftbridge-run --replica-group-id 0 --num-replica-groups 2 --nproc-per-node 1 -- examples/hf_trainer.py
    ftbridge-run --replica-group-id 1 --num-replica-groups 2 --nproc-per-node 1 -- examples/hf_trainer.py

Each group prints its last step, loss and a checksum of its parameters. Both groups train the model that
plain data parallelism on 2 ranks trains (``torchrun --nproc-per-node 2``
with ``transformers.Trainer``): the same rows, learning rates, ``global_step`` and parameters. What changes
and what is refused: ``docs/huggingface.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

########################################################################
# This is a fully working example of the Transformers Trainer under
# ftbridge: each replica group is its own torchrun world, launched with
# `ftbridge-run`, and a step commits on every group or on none.
#
# The one changed line is marked `# New Code #`; the launch replaces
# `torchrun` (or `accelerate launch`) with one `ftbridge-run` per group.
########################################################################


class Tokens:
    """``rows`` fixed-length rows of seeded random tokens (a stand-in for a tokenized corpus)."""

    def __init__(self, rows: int, length: int, vocab: int) -> None:
        import torch

        self.ids = torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(7))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def training_function(args: argparse.Namespace) -> None:
    """One rank of one replica group (started by ``ftbridge-run``)."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported (it picks it once)
    import transformers
    from accelerate import PartialState
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from ftbridge.events import tensor_checksum

    # New Code #
    # The only change to the script: the fault-tolerant Trainer, under the Trainer's name.
    from ftbridge.integrations.transformers import FaultTolerantTrainer as Trainer

    cpu_group = not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1
    if cpu_group:  # on the CPU Accelerate needs an explicit backend for a group of several ranks
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(backend="gloo")
    ds_config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                 "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": {"stage": 2},
                 "steps_per_print": 10**9}
    training_args = TrainingArguments(
        output_dir=args.output_dir, deepspeed=ds_config, per_device_train_batch_size=args.batch_size,
        num_train_epochs=args.epochs, learning_rate=args.lr, lr_scheduler_type="linear", warmup_steps=5,
        logging_steps=10, save_strategy="no", report_to=[], disable_tqdm=True, seed=args.seed,
        accelerator_config={"use_configured_state": cpu_group})
    transformers.set_seed(args.seed)  # the same initial model in every replica group
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32))
    trainer = Trainer(model=model, args=training_args, train_dataset=Tokens(args.rows, 32, 128))
    result = trainer.train()
    state = trainer.accelerator.get_state_dict(trainer.model_wrapped)
    cfg = trainer.model_wrapped.ftbridge.cfg
    print(f"[replica {cfg.replica_group_id} rank {cfg.group_rank}] step {trainer.state.global_step} "
          f"loss {result.training_loss:.4f} params {tensor_checksum(state.values())}", flush=True)
    trainer.end()  # stops ftbridge (manager, heal server, event log) with Accelerate


def main() -> None:
    parser = argparse.ArgumentParser(description="A Transformers Trainer script under ftbridge.")
    parser.add_argument("--output_dir", default=os.path.join(tempfile.gettempdir(), "ftbridge_hf_trainer"))
    parser.add_argument("--epochs", type=float, default=2)
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
