"""The Transformers Trainer integration's pieces, in one process (no network, no launcher).

* the refusals, each naming the setting and the fix, at construction;
* :class:`FaultTolerantTrainerMixin` composing with a user's Trainer subclass (whose own overrides still
  run): a real one-rank DeepSpeed engine, attached, stays a ``DeepSpeedEngine``; the training loader reads
  the rows of plain data-parallel rank 1 of 2 (replica group 1 of 2); a scripted discard keeps
  ``global_step`` moving while the Trainer holds the learning rate; the Trainer's scheduler is in the heal.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

from ftbridge.config import FTBridgeConfig
from ftbridge.heal.wire import decode_state, encode_state
from ftbridge.integrations.transformers import (
    FaultToleranceCallback,
    FaultTolerantTrainer,
    FaultTolerantTrainerMixin,
    arguments_refusal,
    check_transformers_version,
)
from ftbridge.zero.state import from_wire, to_wire

pytestmark = pytest.mark.timeout(120)

os.environ.setdefault("DS_ACCELERATOR", "cpu")

DS_CONFIG = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
             "train_batch_size": "auto", "gradient_clipping": "auto", "steps_per_print": 10**9,
             "zero_optimization": {"stage": 2}}


def _args(**over):
    acc = SimpleNamespace(split_batches=False, even_batches=True, dispatch_batches=None, use_seedable_sampler=True)
    args = SimpleNamespace(deepspeed=DS_CONFIG, accelerator_config=acc, train_sampling_strategy="random")
    for k, v in over.items():
        setattr(acc if hasattr(acc, k) else args, k, v)
    return args


@pytest.mark.parametrize("over,match", [
    (dict(deepspeed=None), "TrainingArguments(deepspeed="),
    (dict(split_batches=True), "{'split_batches': False}"),
    (dict(even_batches=False), "{'even_batches': True}"),
    (dict(dispatch_batches=True), "{'dispatch_batches': False}"),
    (dict(use_seedable_sampler=False), "{'use_seedable_sampler': True}"),
    (dict(train_sampling_strategy="group_by_length"), "train_sampling_strategy='group_by_length'"),
])
def test_arguments_that_cannot_be_exact_are_refused(over, match):
    assert arguments_refusal(_args()) is None
    assert match in (arguments_refusal(_args(**over)) or "")


def test_sequential_sampling_without_the_seedable_sampler_is_exact():
    assert arguments_refusal(_args(use_seedable_sampler=False, train_sampling_strategy="sequential")) is None


def test_a_warm_spare_is_accepted():
    spare = FTBridgeConfig.resolve(environ={"FTBRIDGE_SPARE_INDEX": "0", "FTBRIDGE_NUM_REPLICA_GROUPS": "2"})
    assert arguments_refusal(_args(), spare) is None


def test_an_unchecked_transformers_release_is_refused():
    check_transformers_version("5.23.0")
    with pytest.raises(RuntimeError, match="found 5.24.0"):
        check_transformers_version("5.24.0")


def test_a_trainer_without_deepspeed_is_refused_when_built(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8))
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match=r"runs DeepSpeed ZeRO: pass TrainingArguments\(deepspeed="):
        FaultTolerantTrainer(model=model, args=args, ft_config=FTBridgeConfig.resolve(environ={}))


def test_slots_are_refused_when_built(tmp_path, single_rank_world):
    with pytest.raises(ValueError, match="FTBRIDGE_SLOTS"):
        _trainer(tmp_path, FaultTolerantTrainer, environ={"FTBRIDGE_SLOTS": "2"})


# -- the mixin on a user's subclass, one rank, a scripted discard -----------------------------------------
class Tokens(torch.utils.data.Dataset):
    """``n`` fixed-length rows of seeded random tokens; row ``i`` carries its index as ``idx``."""

    def __init__(self, n: int = 12) -> None:
        self.ids = torch.randint(0, 32, (n, 8), generator=torch.Generator().manual_seed(7))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i], "idx": i}


def _trainer(tmp_path, cls, environ=None, **kw):
    """A ``cls`` Trainer on a tiny GPT-2, ZeRO-2 on the session's one-rank world, as replica group 1 of 2."""
    import transformers
    from accelerate.state import AcceleratorState
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from tests.fakes import FakeManager

    AcceleratorState._reset_state(reset_partial_state=True)
    transformers.set_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8))
    args = TrainingArguments(output_dir=str(tmp_path), deepspeed=dict(DS_CONFIG), per_device_train_batch_size=2,
                             num_train_epochs=1, optim="sgd", learning_rate=0.5, lr_scheduler_type="linear",
                             warmup_steps=2, max_grad_norm=0.0, remove_unused_columns=False, save_strategy="no",
                             report_to=[], disable_tqdm=True, data_seed=5)
    cfg = FTBridgeConfig.resolve(environ={"FTBRIDGE_NUM_REPLICA_GROUPS": "2", "FTBRIDGE_REPLICA_GROUP_ID": "1",
                                          **(environ or {})}, checksum_every=0)
    return cls(model=model, args=args, train_dataset=Tokens(), ft_config=cfg, manager_factory=FakeManager, **kw)


def _subclass_of_the_trainer():
    """A user's Trainer subclass that overrides ``compute_loss`` (as TRL's trainers do), made fault-tolerant."""
    import transformers

    class UserTrainer(transformers.Trainer):
        losses: list

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            self.rows.append(inputs.pop("idx").tolist())
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            self.losses.append(float(loss))
            return loss

    class FaultTolerantUserTrainer(FaultTolerantTrainerMixin, UserTrainer):
        pass

    return FaultTolerantUserTrainer


@pytest.mark.usefixtures("single_rank_world")
def test_the_mixin_composes_with_a_subclass_and_a_discard_holds_the_learning_rate(tmp_path):
    import deepspeed
    from accelerate.data_loader import prepare_data_loader
    from transformers import TrainerCallback

    from ftbridge.integrations.accelerate import FaultTolerantAccelerator

    lrs, steps = [], []

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, lr_scheduler=None, **kw):
            lrs.append(lr_scheduler.get_last_lr()[0])
            steps.append(state.global_step)

        def on_log(self, args, state, control, logs=None, **kw):
            logged.append(dict(logs))

    logged = []
    trainer = _trainer(tmp_path, _subclass_of_the_trainer(), callbacks=[Record()])
    trainer.rows, trainer.losses = [], []
    assert isinstance(trainer.accelerator, FaultTolerantAccelerator)
    loader = trainer.get_train_dataloader()
    plain = prepare_data_loader(torch.utils.data.DataLoader(Tokens(), batch_size=2, shuffle=True), None,
                                num_processes=2, process_index=1, put_on_device=False, use_seedable_sampler=True,
                                data_seed=5)
    assert len(loader) == len(plain) == 3, "plain data parallelism's length on 2 ranks"

    discard_on = {2}

    class DiscardSecond(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            trainer.model_wrapped.ftbridge.manager.discard_calls = discard_on

    trainer.add_callback(DiscardSecond())
    trainer.train()
    engine = trainer.model_wrapped
    assert type(engine) is deepspeed.DeepSpeedEngine and engine.ftbridge is not None
    assert trainer.rows == [b["idx"].tolist() for b in plain], "group 1 reads plain rank 1's rows"
    assert len(trainer.losses) == 3, "the subclass's compute_loss ran on every batch"
    assert steps == [1, 2, 3], "global_step advances on a discarded step, as on a skipped one"
    assert lrs[0] == lrs[1] < lrs[2], f"the learning rate is held on the discarded step: {lrs}"
    assert engine.global_steps == 2, "DeepSpeed applied the two committed steps only"
    assert "trainer_lr_scheduler" in engine.ftbridge.replica_state()["extra"], "a heal carries the Trainer's scheduler"
    [ft_callback] = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, FaultToleranceCallback)]
    assert ft_callback.discarded == 1 and logged[-1]["ft_discarded_steps"] == 1, "the logs count the discards"
    engine.ftbridge.shutdown()  # not trainer.end(): that also ends the session's one-rank world


@pytest.mark.parametrize("group,saves", [(0, True), (1, False)])
def test_only_replica_group_0_saves(group, saves):
    from transformers import TrainerControl, TrainerState

    from ftbridge.integrations.transformers import FaultToleranceCallback

    accelerator = SimpleNamespace(ft_engine=None, ft_config=SimpleNamespace(replica_group_id=group))
    callback = FaultToleranceCallback(accelerator)
    for hook in (callback.on_step_end, callback.on_epoch_end):
        control = TrainerControl(should_save=True)
        assert hook(None, TrainerState(), control).should_save is saves


@pytest.mark.parametrize("batches,gas", [(10, 1), (10, 2), (10, 3), (7, 4), (1, 3)])
def test_the_stream_position_after_a_step_is_the_trainers_resume_rule(batches, gas):
    """Where a healed group reads next is where the Trainer resumed from a checkpoint at that step would:
    ``_init_training_state``'s epochs and batches, counted in the stream."""
    from ftbridge.integrations.transformers import _stream_position

    per_epoch = max(batches // gas + int(batches % gas > 0), 1)  # set_initial_training_values
    for step in range(4 * per_epoch):
        epochs, in_epoch = step // per_epoch, (step % per_epoch) * gas  # _init_training_state
        assert _stream_position(step, batches, gas) == epochs * batches + in_epoch


def test_a_heal_puts_the_group_at_the_donors_step_and_rows(single_rank_world):
    """The callback's side of a heal: the donor's counters plus the step that healed, the loader moved to the
    rows of the next step, the stop rule decided again, and this group's own place sent to the next joiner."""
    from accelerate.data_loader import prepare_data_loader
    from transformers import TrainerControl, TrainerState

    from ftbridge.integrations.accelerate_data import shard_across_replica_groups

    loader = shard_across_replica_groups(
        prepare_data_loader(torch.utils.data.DataLoader(list(range(40)), batch_size=2), None, num_processes=1,
                            process_index=0, put_on_device=False),
        num_replica_groups=2, replica_group_id=1, group_size=1, group_rank=0, movable=True)
    accelerator = SimpleNamespace(ft_engine=None, ft_config=SimpleNamespace(replica_group_id=1))
    trainer = SimpleNamespace(_globalstep_last_logged=0, _initial_global_step=0)
    callback = FaultToleranceCallback(accelerator, trainer)
    args = SimpleNamespace(gradient_accumulation_steps=1, logging_first_step=False, logging_strategy="no",
                           eval_strategy="no", save_strategy="no", eval_delay=0)
    state = TrainerState(max_steps=20, num_input_tokens_seen=16)
    callback.on_train_begin(args, state, TrainerControl())
    batches = iter(loader)
    assert next(batches).tolist() == [2, 3]  # the step that heals reads its own first rows
    donors_logs = [{"loss": 2.5, "step": 10}, {"eval/loss": float("nan"), "step": 12}]
    best = {"best_metric": 0.5, "best_global_step": 10, "best_model_checkpoint": "out/checkpoint-10"}
    donor = {"global_step": 12, "total_flos": 5.0, "num_input_tokens_seen": 400,
             "log_history": json.dumps(donors_logs), **best}
    callback.load_heal_state(from_wire(callback.heal_state(), decode_state(encode_state(to_wire(donor)))))
    state.global_step, state.num_input_tokens_seen = 1, 24
    control = callback.on_step_end(args, state, TrainerControl(), train_dataloader=loader)
    assert (state.global_step, state.total_flos, state.num_input_tokens_seen) == (13, 5.0, 408)
    assert state.epoch == 13 / 10 and trainer._globalstep_last_logged == 12 and not control.should_training_stop
    assert next(batches).tolist() == [14, 15], "step 14 reads epoch 1's batch 3 (sequential rows): plain rank 1's"
    assert json.dumps(state.log_history) == json.dumps(donors_logs)  # the run's logs, as the donor kept them
    assert (state.best_metric, state.best_global_step, state.best_model_checkpoint) == tuple(best.values())
    state.log_history.append({"loss": 2.0, "step": 13})
    assert callback.heal_state() == {"global_step": 13, "total_flos": 5.0, "num_input_tokens_seen": 408,
                                     "log_history": json.dumps([*donors_logs, {"loss": 2.0, "step": 13}]), **best}
    with pytest.raises(ValueError, match="log_history is not a JSON list of objects"):
        callback.load_heal_state({**donor, "log_history": '{"loss": 1}'})
        callback.on_step_end(args, state, TrainerControl(), train_dataloader=loader)
    callback.load_heal_state({**donor, "global_step": 19})
    assert callback.on_step_end(args, state, TrainerControl(), train_dataloader=loader).should_training_stop


def test_a_saved_checkpoint_is_sealed_after_the_group_waited_and_before_the_rotation(tmp_path, monkeypatch):
    """The order of :meth:`FaultTolerantTrainerMixin.seal_saved_checkpoint`: every rank of the group has
    written (a barrier), then the manifest, then the Trainer's held-back rotation; a rank that saved no
    Trainer state only waits."""
    from ftbridge.integrations import sealed_checkpoints

    order = []
    folder = tmp_path / "checkpoint-5"
    folder.mkdir()
    (folder / "rng_state_1.pth").write_bytes(b"r")
    monkeypatch.setattr(sealed_checkpoints, "seal", lambda path: order.append(("seal", path)))
    trainer = SimpleNamespace(accelerator=SimpleNamespace(wait_for_everyone=lambda: order.append("wait")),
                              _ft_rotation=(str(folder), lambda: order.append("rotate")))
    FaultTolerantTrainerMixin.seal_saved_checkpoint(trainer)
    assert order == ["wait", ("seal", str(folder)), "rotate"] and trainer._ft_rotation is None
    order.clear()
    FaultTolerantTrainerMixin.seal_saved_checkpoint(trainer)
    assert order == ["wait"]
