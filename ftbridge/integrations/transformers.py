"""The Transformers ``Trainer`` with DeepSpeed ZeRO, fault-tolerant across replica groups: ``FaultTolerantTrainer``.

The change to a Trainer script (each replica group launched with ``ftbridge-run ... -- train.py``)::

    from ftbridge.integrations.transformers import FaultTolerantTrainer as Trainer

For a subclass of the Trainer: ``class MyTrainer(FaultTolerantTrainerMixin, SFTTrainer)``. A discarded step is a
skipped one (``state.global_step`` advances). Why: docs/huggingface.md, "The Transformers Trainer".
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any, Callable, Dict, List, Optional

import transformers
import transformers.trainer as trainer_module
from transformers import TrainerCallback
from transformers.trainer_callback import DefaultFlowCallback

from ftbridge.config import FTBridgeConfig
from ftbridge.integrations import accelerate_data, sealed_checkpoints
from ftbridge.integrations.accelerate import FaultTolerantAccelerator

SUPPORTED_TRANSFORMERS = ("5.23.",)
"""Transformers releases this module was checked against (the internals: docs/huggingface.md, "Upstream internals")."""

SAMPLING_STRATEGIES = ("random", "sequential")
"""``TrainingArguments.train_sampling_strategy`` values whose order is the same in every replica group."""


def check_transformers_version(version: str = transformers.__version__) -> None:
    """Raise ``RuntimeError`` (naming both versions) for a release not in :data:`SUPPORTED_TRANSFORMERS`."""
    if not version.startswith(SUPPORTED_TRANSFORMERS):
        raise RuntimeError(
            f"ftbridge's Trainer integration relies on a Trainer checked against transformers "
            f"{', '.join(p + 'x' for p in SUPPORTED_TRANSFORMERS)}; found {version}. "
            "Install a supported release: pip install 'transformers>=5.23,<5.24' (or pip install 'ftbridge[hf]')"
        )


def arguments_refusal(args: Any, ft_config: Optional[FTBridgeConfig] = None) -> Optional[str]:
    """Why ftbridge cannot make a Trainer with ``args`` (``TrainingArguments``) and ``ft_config`` exact, or
    ``None``."""
    if ft_config is not None and ft_config.slots:
        return (f"slots={ft_config.slots} (FTBRIDGE_SLOTS) is not supported by FaultTolerantTrainer: the Trainer's "
                "loop draws its own batches, not the units of absent groups; unset FTBRIDGE_SLOTS (ftbridge-run "
                "--slots), or write the loop with FaultTolerantAccelerator.units() (docs/huggingface.md)")
    if getattr(args, "deepspeed", None) is None:
        return ("FaultTolerantTrainer runs DeepSpeed ZeRO: pass TrainingArguments(deepspeed='ds_config.json') "
                "(or a dict such as {'zero_optimization': {'stage': 2}, 'train_micro_batch_size_per_gpu': 'auto'})")
    acc = args.accelerator_config
    if acc.split_batches:
        return ("accelerator_config split_batches=True is not supported across replica groups: set "
                "TrainingArguments(accelerator_config={'split_batches': False}) and set per_device_train_batch_size "
                "to the global batch divided by the job's ranks (replica groups x ranks per group)")
    if not acc.even_batches:
        return ("accelerator_config even_batches=False gives replica groups loaders of different lengths, which "
                "ends their epochs at different steps: set TrainingArguments(accelerator_config="
                "{'even_batches': True})")
    if acc.dispatch_batches:
        return ("accelerator_config dispatch_batches=True is not supported across replica groups: use a map-style "
                "dataset and TrainingArguments(accelerator_config={'dispatch_batches': False})")
    if not acc.use_seedable_sampler and args.train_sampling_strategy == "random":
        return ("accelerator_config use_seedable_sampler=False draws each epoch's order from each replica group's "
                "own random state: set TrainingArguments(accelerator_config={'use_seedable_sampler': True}) and "
                "the same seed (or data_seed) in every group")
    if args.train_sampling_strategy not in SAMPLING_STRATEGIES:
        return (f"train_sampling_strategy={args.train_sampling_strategy!r} orders the rows per rank of a replica "
                f"group, not of the job: use one of {SAMPLING_STRATEGIES}")
    return None


class FaultToleranceCallback(TrainerCallback):
    """One checkpoint writer across replica groups, the discards in the logs, the Trainer's place carried by a heal.

    Only replica group 0 saves; logs get ``ft_discarded_steps``. After a step that healed, takes the donor's
    :meth:`heal_state` (its counters, ``log_history`` and best-checkpoint record) and moves the
    :class:`~ftbridge.integrations.accelerate_data.MovableLoader` to where plain data parallelism reads next, and
    the ``trainer``'s logging counters with ``global_step``.
    """

    def __init__(self, accelerator: FaultTolerantAccelerator, trainer: Any = None) -> None:
        self.accelerator = accelerator
        self.trainer = trainer
        self.discarded = 0
        self._snapshot: Dict[str, Any] = {"global_step": 0, "total_flos": 0.0, "num_input_tokens_seen": 0}
        self._healed: Optional[Dict[str, Any]] = None
        self._moved = False
        self._state: Any = None  # the TrainerState of the current train()

    def heal_state(self) -> Dict[str, Any]:
        """This group's place at the end of its last step (JSON scalars): what a healing group takes.

        Returns:
            ``global_step``, ``total_flos``, ``num_input_tokens_seen`` as of the last step's end; the Trainer's
            ``log_history`` as JSON text (``str``; its entries hold the logs of every step so far) and its
            ``best_metric``, ``best_global_step``, ``best_model_checkpoint`` (``None`` before any evaluation).
        """
        state = self._state
        return {**self._snapshot,
                "log_history": json.dumps(state.log_history if state is not None else []),
                **{k: getattr(state, k, None) for k in _BEST}}

    def load_heal_state(self, state: Dict[str, Any]) -> None:
        """Keep a donor's :meth:`heal_state`; applied at the end of the step that healed."""
        self._healed = dict(state)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._state = state
        self._take_snapshot(state)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        engine = self.accelerator.ft_engine
        if engine is not None and not engine.ftbridge.last_committed:
            self.discarded += 1
        loader: Any = kwargs.get("train_dataloader")
        if self._healed is not None:
            self._take_donors_place(args, state, control, loader)
        if self._moved:
            n = len(loader)
            state.epoch = _stream_position(state.global_step, n, args.gradient_accumulation_steps) / n
        self._take_snapshot(state)
        return self._one_writer(control)

    def _take_snapshot(self, state: Any) -> None:
        self._snapshot = {"global_step": int(state.global_step), "total_flos": float(state.total_flos),
                          "num_input_tokens_seen": int(state.num_input_tokens_seen)}

    def _take_donors_place(self, args: Any, state: Any, control: Any, loader: Any) -> None:
        donor, self._healed = self._healed, None
        assert donor is not None
        history = _log_history(donor["log_history"])
        if not isinstance(loader, accelerate_data.MovableLoader):
            raise RuntimeError(f"the Trainer trains from a {type(loader).__name__}, not the loader "
                               "FaultTolerantTrainer.get_train_dataloader returns: a healed replica group could not "
                               "read the rows the others read; do not override get_train_dataloader after the mixin")
        own_tokens = int(state.num_input_tokens_seen) - self._snapshot["num_input_tokens_seen"]
        step = int(donor["global_step"]) + 1  # the donor's last step, and the one that healed
        state.global_step = step
        state.total_flos = float(donor["total_flos"])
        state.num_input_tokens_seen = int(donor["num_input_tokens_seen"]) + own_tokens
        state.log_history = history
        for k in _BEST:
            setattr(state, k, donor[k])
        n, gas = len(loader), args.gradient_accumulation_steps
        position, was = _stream_position(step, n, gas), loader.position
        loader.move_to(position)  # a live group healed after a disagreement reads on where it was
        self._moved = True
        if self.trainer is not None:
            self.trainer._globalstep_last_logged = step - 1  # the loss logged next averages the steps run here
            self.trainer._initial_global_step = step - 1
        DefaultFlowCallback().on_step_end(args, state, control)  # log, save, stop: decided on the new step
        log = self.accelerator.ft_engine.ftbridge.log if self.accelerator.ft_engine is not None else None
        if log is not None and position != was:
            log.info("healed: the Trainer continues after global_step %d, reading batch %d of the training stream "
                     "next (%d an epoch), not %d", step, position, n, was)
            if n % gas:
                log.warning("the training loader has %d batches an epoch, not a multiple of "
                            "gradient_accumulation_steps=%d: after this heal, this group's short window at the end of "
                            "an epoch falls at other steps than the other groups' (their samples differ there)",
                            n, gas)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        return self._one_writer(control)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer is not None:
            self.trainer.seal_saved_checkpoint()

    def on_log(self, args: Any, state: Any, control: Any, logs: Optional[dict] = None, **kwargs: Any) -> None:
        if logs is not None:
            logs["ft_discarded_steps"] = self.discarded

    def _one_writer(self, control: Any) -> Any:
        if self.accelerator.ft_config.replica_group_id != 0:
            control.should_save = False
        return control


_BEST = ("best_metric", "best_global_step", "best_model_checkpoint")
"""The Trainer's record of its best evaluation, carried by a heal."""


def _log_history(text: str) -> List[Dict[str, Any]]:
    """A donor's ``log_history`` (JSON text) as the Trainer keeps it.

    Raises:
        ValueError: ``text`` is not JSON for a list of objects.
    """
    history = json.loads(text)
    if not isinstance(history, list) or not all(isinstance(entry, dict) for entry in history):
        raise ValueError("the donor's log_history is not a JSON list of objects")
    return history


def _stream_position(global_step: int, batches_per_epoch: int, gradient_accumulation_steps: int) -> int:
    """Micro-batch position plain data parallelism reads next after ``global_step`` steps (Trainer's resume rule)."""
    per_epoch = max(-(-batches_per_epoch // gradient_accumulation_steps), 1)
    epochs, steps = divmod(global_step, per_epoch)
    return epochs * batches_per_epoch + steps * gradient_accumulation_steps


class FaultTolerantTrainerMixin:
    """Makes a Transformers ``Trainer`` (or a subclass) fault-tolerant across replica groups; put it first among the
    bases.

    Args:
        ft_config: ftbridge settings (keyword-only, as the rest); default ``FTBridgeConfig.resolve()``.
        checksum_every, comm_hook, manager_factory: see :class:`ftbridge.engine.FaultTolerantEngine`.

    Raises:
        ValueError: when the Trainer is built, settings that cannot be exact (:func:`arguments_refusal`,
            :func:`ftbridge.integrations.accelerate.settings_refusal`).
        RuntimeError: a Transformers or Accelerate release ftbridge was not checked against.
    """

    accelerator: FaultTolerantAccelerator
    args: Any
    state: Any
    lr_scheduler: Any
    _ft_callback: FaultToleranceCallback
    _ft_loader: Any
    _ft_rotation: Any

    def __init__(self, *args: Any, ft_config: Optional[FTBridgeConfig] = None, checksum_every: Optional[int] = None,
                 comm_hook: Optional[Callable[..., Any]] = None, manager_factory: Optional[Callable[..., Any]] = None,
                 **kwargs: Any) -> None:
        check_transformers_version()
        self._ft_kwargs: Dict[str, Any] = dict(ft_config=ft_config, checksum_every=checksum_every,
                                               comm_hook=comm_hook, manager_factory=manager_factory)
        super().__init__(*args, **kwargs)
        self._add_fault_tolerance_callback()

    def _add_fault_tolerance_callback(self) -> None:
        """Insert :class:`FaultToleranceCallback` right after ``DefaultFlowCallback`` (after its save decision)."""
        callbacks = self.callback_handler.callbacks  # type: ignore[attr-defined]
        flow = [i for i, cb in enumerate(callbacks) if isinstance(cb, DefaultFlowCallback)]
        self._ft_callback = FaultToleranceCallback(self.accelerator, self)
        callbacks.insert(flow[0] + 1 if flow else len(callbacks), self._ft_callback)

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's ``train``; ``resume_from_checkpoint=True`` takes the newest sealed checkpoint.

        Rebinds ``transformers.trainer.rotate_checkpoints`` and ``skip_first_batches`` during the call.

        Raises:
            ValueError: ``resume_from_checkpoint`` names no whole checkpoint (see ``resume_path``).
        """
        resume_from_checkpoint = sealed_checkpoints.resume_path(resume_from_checkpoint, self.args.output_dir)
        skip_original, rotate_original = trainer_module.skip_first_batches, trainer_module.rotate_checkpoints

        def skip_first_batches(loader: Any, num_batches: int = 0) -> Any:
            if isinstance(loader, accelerate_data.MovableLoader):
                return loader.skip_first(num_batches)
            return skip_original(loader, num_batches)

        def rotate_checkpoints(*rotate_args: Any, **rotate_kwargs: Any) -> None:
            run_dir = str(rotate_kwargs.get("output_dir", rotate_args[0] if rotate_args else ""))
            folder = os.path.join(run_dir, f"checkpoint-{self.state.global_step}")
            self._ft_rotation = (folder, functools.partial(rotate_original, *rotate_args, **rotate_kwargs))

        trainer_module.skip_first_batches, trainer_module.rotate_checkpoints = skip_first_batches, rotate_checkpoints
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]
        finally:
            trainer_module.skip_first_batches, trainer_module.rotate_checkpoints = skip_original, rotate_original

    def seal_saved_checkpoint(self) -> None:
        """Seal the new checkpoint once every rank of the group saved, then rotate; all ranks call it together.

        Raises:
            OSError: the checkpoint cannot be sealed (it stays unsealed and older ones stay; a resume skips it).
        """
        pending, self._ft_rotation = getattr(self, "_ft_rotation", None), None
        self.accelerator.wait_for_everyone()
        if pending is not None:
            folder, rotate = pending
            sealed_checkpoints.seal(folder)
            rotate()

    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's own setup, building a ``FaultTolerantAccelerator`` where it builds an ``Accelerator``.

        Raises:
            ValueError: settings that cannot be exact (see the class).
            RuntimeError: the Trainer built another accelerator (an unsupported release).
        """
        ft_config = self._ft_kwargs["ft_config"]
        if ft_config is None:
            ft_config = self._ft_kwargs["ft_config"] = FTBridgeConfig.resolve()
        refused = arguments_refusal(self.args, ft_config)
        if refused:
            raise ValueError(refused)
        original = trainer_module.Accelerator
        trainer_module.Accelerator = functools.partial(FaultTolerantAccelerator, **self._ft_kwargs)
        try:
            super().create_accelerator_and_postprocess()  # type: ignore[misc]
        finally:
            trainer_module.Accelerator = original
        if not isinstance(self.accelerator, FaultTolerantAccelerator):
            raise RuntimeError(f"the Trainer built a {type(self.accelerator).__name__}, not ftbridge's accelerator: "
                               f"this transformers release ({transformers.__version__}) is not supported")

    def get_train_dataloader(self) -> Any:
        """The Trainer's training loader, re-sharded as plain data parallelism on ``N * group_size`` ranks; a warm
        spare's reads as group 0 until :meth:`create_scheduler`.

        Raises:
            ValueError: a loader that cannot be re-sharded exactly
                (:func:`ftbridge.integrations.accelerate_data.sharding_refusal`).
        """
        loader = super().get_train_dataloader()  # type: ignore[misc]
        cfg = self.accelerator.ft_config
        group = 0 if cfg.spare_index >= 0 else cfg.replica_group_id
        self._ft_loader = accelerate_data.shard_across_replica_groups(
            loader, num_replica_groups=cfg.num_replica_groups, replica_group_id=group,
            group_size=cfg.group_size, group_rank=cfg.group_rank, movable=True)
        return self._ft_loader

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> Any:
        """The Trainer's next accumulation window and its label count (``num_items_in_batch``). With
        ``average_tokens_across_devices`` (the Trainer's default) that count, summed over the group's ranks,
        weights this group's gradient in the cross-replica average (:meth:`ftbridge.engine.FaultTolerantEngine.
        set_step_weight`): the loss is then normalised by the label tokens of the whole job, as plain data
        parallelism's, however unevenly padded rows spread them over the groups."""
        batch_samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)  # type: ignore[misc]
        engine = self.accelerator.ft_engine
        if engine is not None and num_items is not None and self.args.average_tokens_across_devices:
            engine.ftbridge.set_step_weight(float(num_items))
        return batch_samples, num_items

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        """The Trainer's scheduler; once the engine exists, every heal carries its state (unless the engine
        owns it) and the Trainer's place in the run (:class:`FaultToleranceCallback`)."""
        scheduler = super().create_scheduler(num_training_steps, optimizer)  # type: ignore[misc]
        engine = self.accelerator.ft_engine
        if engine is None or getattr(self, "_ft_heal_registered", False):
            return scheduler
        loader = getattr(self, "_ft_loader", None)
        if loader is not None:  # a warm spare's loader read as group 0 until now; any other's stays as it is
            cfg = engine.ftbridge.cfg
            loader.reassign(replica_group_id=cfg.replica_group_id, group_size=cfg.group_size,
                            group_rank=cfg.group_rank)
        engine.ftbridge.register_state("trainer_state", self._ft_callback.heal_state,
                                       self._ft_callback.load_heal_state)
        self._ft_heal_registered = True
        owned_by_engine = engine.lr_scheduler is not None and engine.lr_scheduler in (
            scheduler, getattr(scheduler, "scheduler", None))
        if scheduler is not None and not owned_by_engine:
            engine.ftbridge.register_state("trainer_lr_scheduler", self._scheduler_state, self._load_scheduler_state)
        return scheduler

    def _scheduler_state(self) -> Dict[str, Any]:
        return self.lr_scheduler.state_dict()  # the Trainer's current scheduler (a new train() makes another)

    def _load_scheduler_state(self, state: Dict[str, Any]) -> None:
        self.lr_scheduler.load_state_dict(state)


class FaultTolerantTrainer(FaultTolerantTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` for one replica group of a fault-tolerant DeepSpeed ZeRO job (see the module)."""
