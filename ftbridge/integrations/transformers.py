"""The Transformers ``Trainer`` with DeepSpeed ZeRO, fault-tolerant across replica groups: ``FaultTolerantTrainer``.

The change to a Trainer script (each replica group launched with ``ftbridge-run ... -- train.py``)::

    from ftbridge.integrations.transformers import FaultTolerantTrainer as Trainer

or, for a subclass of the Trainer (TRL's ``SFTTrainer``, your own)::

    class FaultTolerantSFTTrainer(FaultTolerantTrainerMixin, SFTTrainer):
        pass

The DeepSpeed config stays where the Trainer reads it (``TrainingArguments(deepspeed=...)``). What the
mixin changes, through the Trainer's public methods only, and nothing else:

1. ``create_accelerator_and_postprocess`` builds a
   :class:`~ftbridge.integrations.accelerate.FaultTolerantAccelerator` where the Trainer builds an
   ``Accelerator``: the ``DeepSpeedEngine`` the Trainer prepares gets ftbridge attached in place (it stays
   a ``DeepSpeedEngine``: saving, ``unwrap_model`` and evaluation see it as under the plain Trainer), and a
   discarded step reads as a skipped one (``accelerator.optimizer_step_was_skipped``), so the Trainer holds
   the learning rate, as after an fp16 overflow.
2. ``get_train_dataloader`` re-shards the training loader: group G's rank R reads the rows of plain
   data-parallel rank ``G * group_size + R`` of ``N * group_size``, and every loader has plain data
   parallelism's length, so ``max_steps``, the epochs and the schedule's length are plain's
   (:func:`ftbridge.integrations.accelerate_data.shard_across_replica_groups`).
3. ``create_scheduler``: the Trainer's own scheduler steps once per optimizer step, as under plain data
   parallelism (the Trainer does not hand it to Accelerate), and every heal carries its state. A
   scheduler in the DeepSpeed config is the engine's and is carried by the engine's heal.
4. :class:`FaultToleranceCallback`: one checkpoint writer (replica group 0; the others skip the Trainer's
   saves, which would write the same ``output_dir``), the discarded steps in the logs, and a restarted
   group's place in the run: its heal carries the donor's ``global_step`` and its loader moves to the rows
   plain data parallelism reads next (``train`` routes the Trainer's resume skip to the same loader).
5. ``train``: each checkpoint the Trainer writes is sealed (a manifest of its files) before old ones are
   rotated away, and ``resume_from_checkpoint=True`` takes the newest whole one
   (:mod:`ftbridge.integrations.sealed_checkpoints`).

``state.global_step`` advances on a discarded step, as on a skipped one: every group counts the same
steps as plain data parallelism, and a run with ``D`` discards makes ``max_steps - D`` updates.

Refused when the Trainer is built, each with a ``ValueError`` naming the setting and the fix
(:func:`arguments_refusal`, then what :class:`~ftbridge.integrations.accelerate.FaultTolerantAccelerator`
refuses): no DeepSpeed config, ``accelerator_config`` with ``split_batches``, ``even_batches=False``,
``dispatch_batches`` or ``use_seedable_sampler=False``, a ``train_sampling_strategy`` other than ``"random"``
or ``"sequential"`` (the length-grouped samplers order rows per rank), ``FTBRIDGE_SLOTS``, tensor, context or
sequence parallelism, fp8; and a Transformers release ftbridge was not checked against (``RuntimeError``).

Exact only for the loss of a window with the same number of label tokens in every group (fixed-length,
unpadded batches) while ``average_tokens_across_devices`` is on (the Trainer's default): the Trainer
counts tokens within the group. With padded batches set ``average_tokens_across_devices=False``.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Dict, Optional

import transformers
import transformers.trainer as trainer_module
from transformers import TrainerCallback
from transformers.trainer_callback import DefaultFlowCallback

from ftbridge.config import FTBridgeConfig
from ftbridge.integrations import accelerate_data, sealed_checkpoints
from ftbridge.integrations.accelerate import FaultTolerantAccelerator

SUPPORTED_TRANSFORMERS = ("5.23.",)
"""Transformers release prefixes this module was checked against: ``trainer.Accelerator`` as the name
``create_accelerator_and_postprocess`` builds from, the training loop's reading of
``optimizer_step_was_skipped``, its scheduler created after ``prepare`` and never handed to Accelerate."""

SAMPLING_STRATEGIES = ("random", "sequential")
"""``TrainingArguments.train_sampling_strategy`` values whose order is the same in every replica group."""


def check_transformers_version(version: str = transformers.__version__) -> None:
    """Refuse a Transformers release whose Trainer ftbridge has not been checked against.

    Raises:
        RuntimeError: naming the installed and the supported versions.
    """
    if not version.startswith(SUPPORTED_TRANSFORMERS):
        raise RuntimeError(
            f"ftbridge's Trainer integration relies on a Trainer checked against transformers "
            f"{', '.join(p + 'x' for p in SUPPORTED_TRANSFORMERS)}; found {version}. "
            "Install a supported release: pip install 'transformers>=5.23,<5.24' (or pip install 'ftbridge[hf]')"
        )


def arguments_refusal(args: Any, ft_config: Optional[FTBridgeConfig] = None) -> Optional[str]:
    """Why ftbridge cannot make a Trainer with ``args`` exact across replica groups, or ``None``.

    Args:
        args: the ``TrainingArguments`` (any object with their attributes).
        ft_config: ftbridge's settings, when known.
    """
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
    """One checkpoint writer across replica groups, the discarded steps in the logs, and the Trainer's place
    in the run carried by a heal.

    On every replica group but 0 it turns the Trainer's saves off (``control.should_save``). The logs the
    reporters and printers receive get ``ft_discarded_steps``, the steps discarded since training began in
    this group (``state.log_history`` keeps the Trainer's own entries).

    A heal (a restarted replica group joining the live ones) carries :meth:`heal_state`: the donor's
    ``global_step``, ``total_flos`` and ``num_input_tokens_seen`` at the end of its last step. At the end
    of the step that healed (:meth:`on_step_end`), the healed group takes the donor's ``global_step`` plus
    that step, moves its training loader (a :class:`~ftbridge.integrations.accelerate_data.MovableLoader`)
    to the rows plain data parallelism reads next (the Trainer's own resume rule: ``global_step //
    num_update_steps_per_epoch`` epochs, then ``global_step % num_update_steps_per_epoch`` windows of
    ``gradient_accumulation_steps`` batches), and decides logging, saving and stopping again from the new
    ``global_step``. From then on it reads, steps and stops with the other groups.

    Args:
        accelerator: the Trainer's :class:`~ftbridge.integrations.accelerate.FaultTolerantAccelerator`.
        trainer: the Trainer, whose logging counters a heal moves with ``global_step``.
    """

    def __init__(self, accelerator: FaultTolerantAccelerator, trainer: Any = None) -> None:
        self.accelerator = accelerator
        self.trainer = trainer
        self.discarded = 0
        self._snapshot: Dict[str, Any] = {"global_step": 0, "total_flos": 0.0, "num_input_tokens_seen": 0}
        self._healed: Optional[Dict[str, Any]] = None
        self._moved = False

    def heal_state(self) -> Dict[str, Any]:
        """This group's place at the end of its last step (JSON scalars): what a healing group takes."""
        return dict(self._snapshot)

    def load_heal_state(self, state: Dict[str, Any]) -> None:
        """Keep a donor's :meth:`heal_state`; applied at the end of the step that healed."""
        self._healed = dict(state)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
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
        if not isinstance(loader, accelerate_data.MovableLoader):
            raise RuntimeError(f"the Trainer trains from a {type(loader).__name__}, not the loader "
                               "FaultTolerantTrainer.get_train_dataloader returns: a healed replica group could not "
                               "read the rows the others read; do not override get_train_dataloader after the mixin")
        own_tokens = int(state.num_input_tokens_seen) - self._snapshot["num_input_tokens_seen"]
        step = int(donor["global_step"]) + 1  # the donor's last step, and the one that healed
        state.global_step = step
        state.total_flos = float(donor["total_flos"])
        state.num_input_tokens_seen = int(donor["num_input_tokens_seen"]) + own_tokens
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


def _stream_position(global_step: int, batches_per_epoch: int, gradient_accumulation_steps: int) -> int:
    """Where plain data parallelism's Trainer reads next after ``global_step`` optimizer steps (micro-batches
    from the first of epoch 0): the rule of the Trainer's own resume (``_init_training_state``)."""
    per_epoch = max(-(-batches_per_epoch // gradient_accumulation_steps), 1)
    epochs, steps = divmod(global_step, per_epoch)
    return epochs * batches_per_epoch + steps * gradient_accumulation_steps


class FaultTolerantTrainerMixin:
    """Makes a Transformers ``Trainer`` (or a subclass) fault-tolerant across replica groups.

    Put it first among the bases: ``class MyTrainer(FaultTolerantTrainerMixin, SomeTrainer)``. Takes the
    Trainer's arguments, plus ftbridge's own (keyword-only). See the module docstring for what changes.

    Args:
        ft_config: ftbridge settings; default resolved from ``FTBRIDGE_*`` and the launcher's environment.
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
        """:class:`FaultToleranceCallback` right after the Trainer's ``DefaultFlowCallback``: it sees the
        saves that one decided, and adds to the logs before the reporters and printers read them."""
        callbacks = self.callback_handler.callbacks  # type: ignore[attr-defined]
        flow = [i for i, cb in enumerate(callbacks) if isinstance(cb, DefaultFlowCallback)]
        self._ft_callback = FaultToleranceCallback(self.accelerator, self)
        callbacks.insert(flow[0] + 1 if flow else len(callbacks), self._ft_callback)

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's ``train``, its checkpoints sealed and its resume skip moved by a heal.

        For the duration of this call, two names in ``transformers.trainer`` lead to ftbridge:
        ``rotate_checkpoints`` is held back until the checkpoint the Trainer has just written is sealed
        (:meth:`seal_saved_checkpoint`, from :meth:`FaultToleranceCallback.on_save`), and
        ``skip_first_batches`` gives the loader of :meth:`get_train_dataloader` its skip
        (:meth:`~ftbridge.integrations.accelerate_data.MovableLoader.skip_first`) instead of another loader,
        so a heal in a resumed epoch still moves what the Trainer reads. ``resume_from_checkpoint=True``
        takes the newest sealed checkpoint (:func:`ftbridge.integrations.sealed_checkpoints.resume_path`).

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
        """Seal the checkpoint the Trainer has just written, then rotate old ones away; every rank of the
        writing group calls it together (after the Trainer's save, :meth:`FaultToleranceCallback.on_save`).

        The group waits for all its ranks first: each writes its own files (its random states) after the
        DeepSpeed save. The process the Trainer saves its state from (``args.should_save``) then writes the
        manifest (:func:`ftbridge.integrations.sealed_checkpoints.seal`) and only then runs the Trainer's
        rotation (``save_total_limit``), which it held back.

        Raises:
            OSError: the checkpoint cannot be sealed (it stays unsealed, older ones stay; a resume skips it).
        """
        pending, self._ft_rotation = getattr(self, "_ft_rotation", None), None
        self.accelerator.wait_for_everyone()
        if pending is not None:
            folder, rotate = pending
            sealed_checkpoints.seal(folder)
            rotate()

    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's own setup, building a ``FaultTolerantAccelerator`` where it builds an ``Accelerator``.

        The Trainer reads the class from the name ``Accelerator`` in ``transformers.trainer``, with no
        argument to pass another; that name is bound to ftbridge's class for the duration of this call
        only (checked against :data:`SUPPORTED_TRANSFORMERS`).

        Raises:
            ValueError: settings that cannot be exact (see the class).
            RuntimeError: the Trainer built something else (a release that builds its accelerator elsewhere).
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
        """The Trainer's training loader, re-sharded as plain data parallelism on ``N * group_size`` ranks.

        A warm spare does not know yet which replica group it will train as (the Trainer builds its loader
        before the engine, where a spare stands by): its loader reads as group 0 until
        :meth:`create_scheduler`, after the takeover, points it at the group taken over.

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

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        """The Trainer's scheduler; once the engine exists, every heal carries ``self.lr_scheduler``'s state
        and the Trainer's place in the run (:class:`FaultToleranceCallback`).

        A scheduler from the DeepSpeed config is the engine's, which the engine's heal carries already.
        """
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
