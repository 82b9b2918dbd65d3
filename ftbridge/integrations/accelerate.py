"""Hugging Face Accelerate with DeepSpeed ZeRO, fault-tolerant across replica groups: :class:`FaultTolerantAccelerator`.

The change to an Accelerate training script (each replica group launched with ``ftbridge-run``)::

    from ftbridge.integrations.accelerate import FaultTolerantAccelerator as Accelerator

    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2, ...))
    model, optimizer, train_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, scheduler)
    train_dl = accelerator.shard_across_replica_groups(train_dl)   # the training loader only

What it changes, and nothing else:

1. The ``DeepSpeedEngine`` Accelerate builds in ``prepare`` gets ftbridge attached in place
   (:func:`ftbridge.attach`): it stays a ``DeepSpeedEngine`` (``unwrap_model``, ``get_state_dict`` and
   ``save_model`` see the model as under plain Accelerate), ``accelerator.backward`` and
   ``engine.step()`` commit or discard the step on every replica group, and the controller is
   ``model.ftbridge`` (``register_state``, the event log, ``last_committed``).
2. A discarded step is a skipped step to Accelerate: the DeepSpeed optimizer's ``overflow`` flag is set
   (:func:`mark_discarded_steps`), so ``accelerator.optimizer_step_was_skipped`` is true and the prepared
   scheduler holds the learning rate, as after an fp16 overflow. DeepSpeed clears the flag at its next step.
   The discarded batch is consumed, not retried: Accelerate's loop has already drawn it.
3. A prepared torch scheduler steps as under plain data parallelism on ``N * group_size`` ranks
   (:class:`ReplicaGroupsScheduler`), and a heal carries its state; a DeepSpeed-native scheduler (one
   DeepSpeed steps itself) is the engine's and was exact already.
4. :meth:`FaultTolerantAccelerator.shard_across_replica_groups` re-shards the training loader
   (:mod:`ftbridge.integrations.accelerate_data`).
5. ``save_state`` is written by replica group 0 only and sealed; ``load_state`` loads whole checkpoints
   only (:mod:`ftbridge.integrations.sealed_checkpoints`).

Refused at construction or ``prepare``, each with a ``ValueError`` naming the setting and the fix: no
DeepSpeed plugin, several DeepSpeed plugins, ``split_batches``, ``even_batches=False``,
``dispatch_batches``, tensor, context or sequence parallelism (``ParallelismConfig``, DeepSpeed AutoTP,
an ``mpu``), fp8 (MS-AMP patches ``deepspeed.initialize``), ``FTBRIDGE_SLOTS``, a scheduler prepared
before the model, ``DummyScheduler(total_num_steps=...)`` (Accelerate divides it by the group's size);
and an Accelerate release ftbridge was not checked against (``RuntimeError``).
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Callable, Dict, List, Optional

import accelerate
import deepspeed
from accelerate import Accelerator
from accelerate.scheduler import AcceleratedScheduler

from ftbridge.bootstrap import attach
from ftbridge.config import FTBridgeConfig
from ftbridge.integrations import accelerate_data, sealed_checkpoints

SUPPORTED_ACCELERATE = ("1.15.",)
"""Accelerate release prefixes whose internals this module was checked against: the engine among
``prepare``'s outputs, ``AcceleratedScheduler``'s steps per optimizer step, the optimizer wrapper's reading
of DeepSpeed's ``overflow`` flag, ``DataLoaderShard`` and ``BatchSamplerShard``."""


def check_accelerate_version(version: str = accelerate.__version__) -> None:
    """Refuse an Accelerate release whose internals ftbridge has not been checked against.

    Raises:
        RuntimeError: naming the installed and the supported versions.
    """
    if not version.startswith(SUPPORTED_ACCELERATE):
        raise RuntimeError(
            f"ftbridge's Accelerate integration relies on internals checked against accelerate "
            f"{', '.join(p + 'x' for p in SUPPORTED_ACCELERATE)}; found {version}. "
            "Install a supported release: pip install 'accelerate>=1.15,<1.16' (or pip install 'ftbridge[hf]')"
        )


class ReplicaGroupsScheduler(AcceleratedScheduler):
    """Accelerate's scheduler wrapper, stepping as plain data parallelism on ``N * group_size`` ranks would.

    Accelerate steps a wrapped scheduler ``num_processes`` times per optimizer step (the global batch
    grows with the processes); in a replica group ``num_processes`` is the group's size. This wrapper
    runs Accelerate's own step ``replica_groups`` times per optimizer step, so the schedule advances
    ``N * group_size`` steps, each under Accelerate's own rules (held on a skipped step, a
    ``OneCycleLR`` stopped at its ``total_steps``). Outside an optimizer step (``sync_gradients``
    false) and with ``step_with_optimizer=False`` it is Accelerate's step once, as under plain
    data parallelism.

    Args:
        scheduler, optimizers, step_with_optimizer, split_batches: as for ``AcceleratedScheduler``.
        replica_groups: ``N``, the job's replica groups (>= 1).
    """

    def __init__(self, scheduler: Any, optimizers: Any, *, replica_groups: int, step_with_optimizer: bool = True,
                 split_batches: bool = False) -> None:
        if replica_groups < 1:
            raise ValueError(f"replica_groups={replica_groups} must be >= 1")
        super().__init__(scheduler, optimizers, step_with_optimizer=step_with_optimizer, split_batches=split_batches)
        self.replica_groups = replica_groups

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self.step_with_optimizer or not self.gradient_state.sync_gradients:
            super().step(*args, **kwargs)
            return
        for _ in range(self.replica_groups):
            super().step(*args, **kwargs)


def mark_discarded_steps(engine: Any) -> None:
    """Make a discarded step read as skipped: set the DeepSpeed optimizer's ``overflow`` flag on a discard.

    Accelerate's ``DeepSpeedOptimizerWrapper.step_was_skipped`` (and so the scheduler wrappers and
    ``accelerator.optimizer_step_was_skipped``) and the Transformers Trainer read that flag. A commit leaves
    it as DeepSpeed's step set it; DeepSpeed's next step clears it.

    Args:
        engine: a ``DeepSpeedEngine`` with ftbridge attached (``engine.ftbridge``).
    """
    optimizer = engine.optimizer

    def on_step(committed: bool) -> None:
        if not committed:
            optimizer.overflow = True

    engine.ftbridge.add_step_hook(on_step)


def settings_refusal(accelerator: Any) -> Optional[str]:
    """Why ftbridge cannot make ``accelerator``'s settings exact across replica groups, or ``None``.

    Args:
        accelerator: an ``accelerate.Accelerator`` (any object with its attributes).
    """
    from accelerate.utils import DistributedType

    state = accelerator.state
    if accelerator.distributed_type != DistributedType.DEEPSPEED or state.deepspeed_plugin is None:
        return ("FaultTolerantAccelerator runs DeepSpeed ZeRO: pass deepspeed_plugin=DeepSpeedPlugin(zero_stage=2, "
                "...) (or set ACCELERATE_USE_DEEPSPEED=true and ACCELERATE_DEEPSPEED_CONFIG_FILE)")
    plugins = getattr(state, "deepspeed_plugins", None)
    if isinstance(plugins, dict) and len(plugins) > 1:
        return "several DeepSpeed plugins (several engines) are not supported by ftbridge: pass one deepspeed_plugin"
    config = state.deepspeed_plugin.deepspeed_config or {}
    if int(dict(config.get("tensor_parallel") or {}).get("autotp_size", 0) or 0) > 1:
        return ("tensor_parallel.autotp_size > 1 splits the replica group into model-parallel ranks, which "
                "ftbridge does not support: remove the tensor_parallel section")
    pc = accelerator.parallelism_config
    sizes = {k: int(getattr(pc, k, 1) or 1) for k in ("tp_size", "cp_size", "sp_size")} if pc is not None else {}
    if any(v > 1 for v in sizes.values()):
        return (f"ParallelismConfig({', '.join(f'{k}={v}' for k, v in sizes.items() if v > 1)}) splits the replica "
                "group into model- or sequence-parallel ranks, which ftbridge does not support: leave them at 1")
    if str(getattr(accelerator, "mixed_precision", "no")) == "fp8":
        return "mixed_precision='fp8' is not supported by ftbridge (MS-AMP replaces deepspeed.initialize): use bf16"
    if accelerator.split_batches:
        return ("split_batches=True is not supported across replica groups: set "
                "DataLoaderConfiguration(split_batches=False) and give the loader the batch of one rank: the "
                "global batch divided by the job's ranks (replica groups x ranks per group)")
    if not accelerator.even_batches:
        return ("even_batches=False gives replica groups loaders of different lengths, which ends their epochs "
                "at different steps: set DataLoaderConfiguration(even_batches=True)")
    if accelerator.dispatch_batches:
        return ("dispatch_batches=True is not supported across replica groups: use a map-style dataset and "
                "DataLoaderConfiguration(dispatch_batches=False)")
    return None


def scheduler_refusal(args: Any) -> Optional[str]:
    """Why a scheduler among ``prepare``'s arguments cannot step as under plain data parallelism, or ``None``."""
    from accelerate.utils import DummyScheduler

    for obj in args:
        if isinstance(obj, DummyScheduler) and obj.total_num_steps is not None:
            return ("DummyScheduler(total_num_steps=...) is divided by the replica group's processes, not the job's "
                    "data-parallel ranks: set scheduler.params.total_num_steps (optimizer steps) in the DeepSpeed "
                    "config and leave total_num_steps None")
    return None


class FaultTolerantAccelerator(Accelerator):
    """``accelerate.Accelerator`` for one replica group of a fault-tolerant DeepSpeed ZeRO job.

    Takes ``Accelerator``'s arguments, plus ftbridge's own (keyword-only). See the module docstring for
    what changes; everything else is Accelerate's.

    Args:
        ft_config: ftbridge settings; default resolved from ``FTBRIDGE_*`` and the launcher's environment.
        checksum_every, comm_hook, manager_factory: see :class:`ftbridge.engine.FaultTolerantEngine`.

    Raises:
        ValueError: at construction, settings that cannot be exact (:func:`settings_refusal`) or
            ``FTBRIDGE_SLOTS`` (not supported here yet).
        RuntimeError: an Accelerate release ftbridge was not checked against.
    """

    _dataloaders: List[Any]  # Accelerate's own lists of what it prepared (set in its __init__)
    _schedulers: List[Any]

    def __init__(self, *args: Any, ft_config: Optional[FTBridgeConfig] = None, checksum_every: Optional[int] = None,
                 comm_hook: Optional[Callable[..., Any]] = None, manager_factory: Optional[Callable[..., Any]] = None,
                 **kwargs: Any) -> None:
        check_accelerate_version()
        super().__init__(*args, **kwargs)
        refused = settings_refusal(self)
        if refused:
            raise ValueError(refused)
        self.ft_config = ft_config if ft_config is not None else FTBridgeConfig.resolve()
        if self.ft_config.slots:
            raise ValueError(f"slots={self.ft_config.slots} (FTBRIDGE_SLOTS) is not supported under Accelerate yet: "
                             "unset FTBRIDGE_SLOTS (ftbridge-run --slots)")
        self._attach_kwargs: Dict[str, Any] = dict(checksum_every=checksum_every, comm_hook=comm_hook,
                                                   manager_factory=manager_factory)
        self.ft_engine: Any = None
        """The ``DeepSpeedEngine`` ftbridge is attached to, once ``prepare`` built it."""

    def prepare(self, *args: Any, device_placement: Any = None) -> Any:
        """``Accelerator.prepare``; the DeepSpeed engine it builds gets ftbridge, its schedulers step per job.

        Raises:
            ValueError: a second model (one engine per accelerator), a scheduler prepared before the
                model, or what :func:`ftbridge.attach` refuses.
        """
        refused = scheduler_refusal(args)
        if refused:
            raise ValueError(refused)
        result = super().prepare(*args, device_placement=device_placement)
        outs = list(result) if len(args) > 1 else [result]
        for obj in outs:
            if isinstance(obj, deepspeed.DeepSpeedEngine) and obj is not self.ft_engine:
                self._attach(obj)
        outs = [self._per_job(obj) if type(obj) is AcceleratedScheduler else obj for obj in outs]
        return tuple(outs) if len(args) > 1 else outs[0]

    def prepare_scheduler(self, scheduler: Any) -> Any:
        """``Accelerator.prepare_scheduler``, stepping as plain data parallelism (:class:`ReplicaGroupsScheduler`)."""
        prepared = super().prepare_scheduler(scheduler)
        return self._per_job(prepared) if type(prepared) is AcceleratedScheduler else prepared

    def shard_across_replica_groups(self, loader: Any) -> Any:
        """The prepared training loader, re-sharded as plain data parallelism on ``N * group_size`` ranks.

        Group G's rank R reads exactly the rows of plain data-parallel rank ``G * group_size + R``, and
        every rank's loader has the same length
        (:func:`ftbridge.integrations.accelerate_data.shard_across_replica_groups`).
        Leave evaluation loaders as they are (each group evaluates the whole set).

        Args:
            loader: what ``prepare`` returned for the training ``DataLoader``, after the model was prepared.

        Returns:
            The new loader (use it instead of ``loader``; Accelerate's state tracks it in its place).

        Raises:
            ValueError: the model is not prepared yet (the group's id is known once a warm spare took one),
                or a loader that cannot be re-sharded exactly.
        """
        if self.ft_engine is None:
            raise ValueError("prepare the model first (accelerator.prepare(model, optimizer, ...)), then shard the "
                             "training loader: a warm spare learns which replica group it trains as there")
        cfg = self.ft_engine.ftbridge.cfg
        out = accelerate_data.shard_across_replica_groups(
            loader, num_replica_groups=cfg.num_replica_groups, replica_group_id=cfg.replica_group_id,
            group_size=cfg.group_size, group_rank=cfg.group_rank)
        self._dataloaders = [out if d is loader else d for d in self._dataloaders]
        return out

    def save_state(self, output_dir: Optional[str] = None, safe_serialization: bool = True,
                   **save_model_func_kwargs: Any) -> Optional[str]:
        """``Accelerator.save_state``, written by one replica group and sealed.

        Replica group 0 writes (every rank of it, as Accelerate does); then its main process seals the
        folder (:func:`ftbridge.integrations.sealed_checkpoints.seal`) and only then deletes the oldest
        automatically named checkpoints beyond ``ProjectConfiguration(total_limit=...)`` (Accelerate
        deletes them before writing the new one). The other groups write nothing, count the save as
        Accelerate does (``save_iteration``) and return ``None``: every group's folder names stay equal.

        Returns:
            The folder written, on replica group 0; ``None`` elsewhere.

        Raises:
            OSError: the checkpoint cannot be written or sealed (it stays unsealed; a resume skips it).
        """
        config = self.project_configuration
        if self.ft_config.replica_group_id != 0:
            config.iteration += 1
            return None
        folder = (os.path.join(self.project_dir, "checkpoints", f"checkpoint_{self.save_iteration}")
                  if config.automatic_checkpoint_naming else str(output_dir))
        limit, config.total_limit = config.total_limit, None
        try:
            super().save_state(output_dir, safe_serialization, **save_model_func_kwargs)
        finally:
            config.total_limit = limit
        self.wait_for_everyone()  # every rank's files of the group are written
        if self.is_main_process:
            sealed_checkpoints.seal(folder)
            if config.automatic_checkpoint_naming and limit is not None:
                older = sealed_checkpoints.checkpoints(os.path.dirname(folder), sealed_checkpoints.ACCELERATE)
                for _, path in older[max(limit, 1):]:
                    shutil.rmtree(path)
        self.wait_for_everyone()
        return folder

    def load_state(self, input_dir: Optional[str] = None, load_kwargs: Optional[dict] = None,
                   **load_model_func_kwargs: Any) -> Any:
        """``Accelerator.load_state`` of a whole checkpoint only.

        Without ``input_dir`` (automatic checkpoint naming), the newest sealed ``checkpoint_<n>`` is loaded,
        not the newest folder; a named folder that has a manifest must match it.

        Raises:
            ValueError: no whole checkpoint to load, or a named folder that does not match its manifest.
        """
        if input_dir is None and self.project_configuration.automatic_checkpoint_naming:
            root = os.path.join(self.project_dir, "checkpoints")
            input_dir = sealed_checkpoints.latest_sealed(root, sealed_checkpoints.ACCELERATE)
            if input_dir is None:
                raise ValueError(f"no whole checkpoint in {root} (a checkpoint_<n> folder sealed with a manifest.json "
                                 "that its files match): name a folder, or start without load_state")
        elif input_dir is not None:
            sealed_checkpoints.check_named(input_dir)
        return super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)

    def end_training(self) -> None:
        """Stop ftbridge (manager, heal server, event log), then Accelerate's ``end_training``."""
        if self.ft_engine is not None:
            self.ft_engine.ftbridge.shutdown()
        super().end_training()

    def _attach(self, engine: Any) -> None:
        if self.ft_engine is not None:
            raise ValueError("a second model was prepared: a FaultTolerantAccelerator trains one DeepSpeed engine; "
                             "prepare one model per accelerator")
        attach(engine, ft_config=self.ft_config, **self._attach_kwargs)
        mark_discarded_steps(engine)
        self.ft_engine = engine
        self.ft_config = engine.ftbridge.cfg  # a warm spare's: the replica group it took over

    def _per_job(self, prepared: AcceleratedScheduler) -> ReplicaGroupsScheduler:
        """``prepared`` as a :class:`ReplicaGroupsScheduler`, in Accelerate's list too, its state in every heal."""
        if self.ft_engine is None:
            raise ValueError("a scheduler was prepared before the model: prepare the model, optimizer and "
                             "scheduler in one call, accelerator.prepare(model, optimizer, loader, scheduler)")
        out = ReplicaGroupsScheduler(prepared.scheduler, prepared.optimizers,
                                     replica_groups=self.ft_engine.ftbridge.cfg.num_replica_groups,
                                     step_with_optimizer=prepared.step_with_optimizer,
                                     split_batches=prepared.split_batches)
        out._is_accelerate_prepared = True  # as Accelerate marks what it prepared
        self._schedulers = [out if s is prepared else s for s in self._schedulers]
        key = f"accelerate_scheduler_{sum(isinstance(s, ReplicaGroupsScheduler) for s in self._schedulers) - 1}"
        self.ft_engine.ftbridge.register_state(key, out.state_dict, out.load_state_dict)
        return out
