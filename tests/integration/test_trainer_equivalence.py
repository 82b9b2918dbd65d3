"""FaultTolerantTrainer end to end: 2 replica groups x 1 rank against the plain Trainer + DeepSpeed on 2 ranks.

This file is also the worker both runs execute (``python test_trainer_equivalence.py --plain ...`` under
torchrun, ``ftbridge-run ... -- test_trainer_equivalence.py ...`` per group): a tiny GPT-2 built from a config,
a fixed-length token dataset, ``Trainer`` with ``TrainingArguments(deepspeed=...)`` (ZeRO), plain SGD with no
clipping and a linear schedule with warm-up, shuffled rows. The fault-tolerant run differs by one line, the
import of ``FaultTolerantTrainer as Trainer``. Group G must read plain rank G's rows, take the same optimizer
steps (``global_step``) at the same learning rates, and end with the plain run's parameters.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import pytest
import torch

WORKER = os.path.abspath(__file__)

ATOL = 1e-6
"""Parameters of the two runs may differ by the order of floating-point sums (2 ranks vs 2 groups)."""


def _run_both(local_job, tmp_path, extra=()):
    """This file's worker as a fault-tolerant job of 2 groups and as plain DeepSpeed on 2 ranks: ``(ft, plain)``."""
    from tests.integration.hf_runs import run_ft_and_plain

    return run_ft_and_plain(local_job, tmp_path, WORKER, extra, env={"HF_HUB_OFFLINE": "1"})


def _max_diff(a, b):
    return max((a[n] - b[n]).abs().max().item() for n in b)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage,gas,padded", [
    (2, 1, False),
    (2, 2, True),  # label tokens differ per group: each group's gradient weighs by its count
    pytest.param(1, 1, False, marks=pytest.mark.slow),
    pytest.param(3, 1, True, marks=pytest.mark.slow),
    pytest.param(2, 2, False, marks=pytest.mark.slow),
    pytest.param(2, 3, False, marks=pytest.mark.slow),  # 10 batches an epoch: the last window holds one
], ids=["zero2", "zero2-gas2-padded", "zero1", "zero3-padded", "zero2-gas2", "zero2-gas3"])
def test_fault_tolerant_trainer_trains_the_model_of_the_plain_trainer(local_job, tmp_path, stage, gas, padded):
    pytest.importorskip("transformers")
    ft, plain = _run_both(local_job, tmp_path, ["--stage", str(stage), "--gas", str(gas)] + ["--padded"] * padded)
    for r, (got, want) in enumerate(zip(ft, plain)):
        assert got["trainer_type"] == "FaultTolerantTrainer" and want["trainer_type"] == "Trainer"
        assert got["is_deepspeed_engine"], got["engine_type"]
        assert got["rows"] == want["rows"], f"data-parallel rank {r} reads plain rank {r}'s rows"
        assert got["global_steps"] == want["global_steps"], "global_step after every optimizer step"
        assert got["lrs"] == pytest.approx(want["lrs"], rel=1e-12, abs=0), "the same learning rate every step"
        assert got["max_steps"] == want["max_steps"] and got["discarded"] == 0
    for r in range(len(ft)):
        if ft[r]["params"]:  # under ZeRO-3 only a world's rank 0 gathers
            assert all(torch.equal(ft[r]["params"][n], ft[0]["params"][n]) for n in ft[0]["params"]), "groups differ"
    diff = _max_diff(ft[0]["params"], plain[0]["params"])
    print(f"ZeRO-{stage} gas {gas}: max |ft - plain| = {diff:.3g} over {ft[0]['global_steps'][-1]} steps")
    for name, want in plain[0]["params"].items():
        torch.testing.assert_close(ft[0]["params"][name], want, rtol=0, atol=ATOL, msg=name)
    moved = _max_diff(plain[0]["params"], plain[0]["initial"])
    assert moved > 1000 * ATOL, f"training moved the parameters by {moved} only"
    lrs = plain[0]["lrs"]
    assert lrs[0] < max(lrs) and lrs[-1] < max(lrs), "warm-up then decay: a step-count error would show"


@pytest.mark.slow  # a negative control: ~20 s
@pytest.mark.timeout(300)
def test_padded_rows_without_the_token_weight_train_another_model(local_job, tmp_path):
    """The negative control of the padded case: groups averaged alike, each normalised by its own label count."""
    pytest.importorskip("transformers")
    ft, plain = _run_both(local_job, tmp_path, ["--gas", "2", "--padded", "--no-weight"])
    assert ft[0]["rows"] == plain[0]["rows"], "the same rows: only the weighting differs"
    diff = _max_diff(ft[0]["params"], plain[0]["params"])
    print(f"padded rows, groups weighted alike: max |ft - plain| = {diff:.3g}")
    assert diff > 100 * ATOL


@pytest.mark.slow  # a negative control: ~35 s
@pytest.mark.timeout(300)
def test_without_resharding_the_groups_train_another_model(local_job, tmp_path):
    """The negative control: groups that read the same rows average identical gradients."""
    pytest.importorskip("transformers")
    ft, plain = _run_both(local_job, tmp_path, ["--no-shard"])
    assert ft[0]["rows"] == ft[1]["rows"], "every group reads the same rows"
    diff = _max_diff(ft[0]["params"], plain[0]["params"])
    print(f"without re-sharding: max |ft - plain| = {diff:.3g}")
    assert diff > 100 * ATOL


@pytest.mark.slow  # a negative control: ~30 s
@pytest.mark.timeout(300)
def test_without_the_cross_replica_average_the_groups_train_apart(local_job, tmp_path):
    """The negative control of the average: each group steps on its own gradient; the rows are plain's."""
    pytest.importorskip("transformers")
    ft, plain = _run_both(local_job, tmp_path, ["--no-sync"])
    assert [r["rows"] for r in ft] == [r["rows"] for r in plain], "the rows of plain data parallelism"
    diff = _max_diff(ft[0]["params"], ft[1]["params"])
    print(f"without the cross-replica average: max |group 0 - group 1| = {diff:.3g}")
    assert diff > 100 * ATOL


# -- the worker --------------------------------------------------------------------------------------------
class Tokens(torch.utils.data.Dataset):
    """``n`` fixed-length rows of seeded random tokens; row ``i`` carries its index as ``idx``. ``padded``: row ``i``'s
    last ``(3 * i) % 7`` labels are -100 (padding), so accumulation windows hold different label counts."""

    def __init__(self, n: int = 40, length: int = 8, vocab: int = 64, padded: bool = False) -> None:
        self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(7))
        self.labels = self.ids.clone()
        if padded:
            for i in range(n):
                pad = (3 * i) % 7
                if pad:
                    self.labels[i, length - pad:] = -100

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.labels[i], "idx": i}


def _worker(argv) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--plain", action="store_true")
    p.add_argument("--out", required=True)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--gas", type=int, default=1)
    p.add_argument("--no-shard", action="store_true")
    p.add_argument("--padded", action="store_true", help="rows with padded labels (Tokens)")
    p.add_argument("--no-weight", action="store_true", help="the negative control: groups weighted alike")
    p.add_argument("--no-sync", action="store_true", help="the negative control: no cross-replica average")
    p.add_argument("--rows", type=int, default=40, help="dataset rows")
    p.add_argument("--max-steps", type=int, default=-1)
    p.add_argument("--save-steps", type=int, default=0, help="save a Trainer checkpoint every N steps (0: never)")
    p.add_argument("--output-dir", help="the Trainer's output_dir (default OUT/trainer)")
    p.add_argument("--resume", action="store_true", help="train(resume_from_checkpoint=True)")
    p.add_argument("--kill-at", type=int, default=0,
                   help="replica group 1 SIGKILLs itself after this global_step, on its first attempt")
    args = p.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

    import deepspeed
    import transformers
    from accelerate import PartialState
    from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

    if args.plain:
        from transformers import Trainer
    else:
        from ftbridge.integrations.transformers import FaultTolerantTrainer as Trainer
        if args.no_shard:  # the negative control: the Trainer's own per-group loader
            Trainer.get_train_dataloader = transformers.Trainer.get_train_dataloader
        if args.no_weight:  # the negative control: no label-token weight per group
            Trainer.get_batch_samples = transformers.Trainer.get_batch_samples

    rows, lrs, steps, step_rows = [], [], [], {}

    class Recording(Trainer):
        """Records the rows each micro-batch trains, by the optimizer step it belongs to."""

        def training_step(self, model, inputs, num_items_in_batch=None):
            trained = inputs.pop("idx").tolist()
            rows.append(trained)
            step_rows.setdefault(self.state.global_step + 1, []).append(trained)
            return super().training_step(model, inputs, num_items_in_batch)

    class Record(TrainerCallback):
        def on_step_end(self, a, state, control, lr_scheduler=None, **kw):
            lrs.append(lr_scheduler.get_last_lr()[0])
            steps.append(state.global_step)
            first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            if (args.kill_at and state.global_step == args.kill_at and first_attempt
                    and os.environ.get("FTBRIDGE_REPLICA_GROUP_ID") == "1"):
                os.kill(os.getpid(), signal.SIGKILL)

    # On the CPU, Accelerate sets up a distributed state only with an explicit backend; the Trainer then uses it.
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")
    ds_config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                 "train_batch_size": "auto", "gradient_clipping": "auto", "steps_per_print": 10**9,
                 "zero_optimization": {"stage": args.stage, "stage3_gather_16bit_weights_on_model_save": True}}
    training_args = TrainingArguments(
        output_dir=args.output_dir or os.path.join(args.out, "trainer"), deepspeed=ds_config,
        per_device_train_batch_size=2, gradient_accumulation_steps=args.gas, num_train_epochs=2,
        max_steps=args.max_steps, optim="sgd", learning_rate=0.5, lr_scheduler_type="linear", warmup_steps=4,
        max_grad_norm=0.0, weight_decay=0.0, remove_unused_columns=False,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500, report_to=[],
        logging_steps=1, seed=0, data_seed=1234,
        disable_tqdm=True, accelerator_config={"use_configured_state": True})
    transformers.set_seed(0)  # the same initial model in every replica group
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
    initial = {n: q.detach().clone() for n, q in model.named_parameters()}
    hook = {}
    if args.no_sync and not args.plain:  # the negative control: each group keeps its own gradient
        from ftbridge.harness.control_hooks import no_sync_hook
        hook = {"comm_hook": no_sync_hook}
    trainer = Recording(model=model, args=training_args, train_dataset=Tokens(args.rows, padded=args.padded),
                        data_collator=transformers.default_data_collator, callbacks=[Record()], **hook)
    trainer.train(resume_from_checkpoint=True if args.resume else None)

    engine = trainer.model_wrapped
    state = trainer.accelerator.get_state_dict(engine) or {}
    if args.plain:
        dp_rank = trainer.args.process_index
    else:
        cfg = engine.ftbridge.cfg
        dp_rank = cfg.replica_group_id * cfg.group_size + cfg.group_rank
    result = {
        "params": {n: q.detach().clone() for n, q in state.items() if n in initial}, "initial": initial,
        "lrs": lrs, "global_steps": steps, "rows": rows, "step_rows": step_rows, "max_steps": trainer.state.max_steps,
        "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "spare": int(os.environ.get("FTBRIDGE_SPARE_INDEX", "-1")) >= 0,
        "logs": [(e["step"], e["loss"]) for e in trainer.state.log_history if "loss" in e],
        "discarded": sum(getattr(cb, "discarded", 0) for cb in trainer.callback_handler.callbacks),
        "trainer_type": Trainer.__name__, "engine_type": type(engine).__name__,
        "is_deepspeed_engine": type(engine) is deepspeed.DeepSpeedEngine,
    }
    os.makedirs(args.out, exist_ok=True)
    torch.save(result, os.path.join(args.out, f"result_{dp_rank}.pt"))
    trainer.end()


if __name__ == "__main__":
    _worker(sys.argv[1:])
