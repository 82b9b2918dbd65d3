"""Hugging Face Accelerate with DeepSpeed ZeRO, fault-tolerant across replica groups: :class:`FaultTolerantAccelerator`.

Import it as ``Accelerator``, then call :meth:`~FaultTolerantAccelerator.shard_across_replica_groups` on the
prepared training loader; or, with slots (``FTBRIDGE_SLOTS``), loop over :meth:`~FaultTolerantAccelerator.units`
and read each unit's rows. The engine stays a ``DeepSpeedEngine`` with ftbridge attached (``model.ftbridge``).
What changes, what is exact and what is refused: docs/huggingface.md.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any, Callable, Dict, Iterator, List, Optional

import accelerate
import deepspeed
from accelerate import Accelerator
from accelerate.scheduler import AcceleratedScheduler

from ftbridge.bootstrap import attach
from ftbridge.config import FTBridgeConfig
from ftbridge.heal import rng
from ftbridge.integrations import accelerate_data, sealed_checkpoints
from ftbridge.slots import Unit

logger = logging.getLogger(__name__)

SUPPORTED_ACCELERATE = ("1.15.",)
"""Accelerate releases this module was checked against (the internals: docs/huggingface.md, "Upstream internals")."""


def check_accelerate_version(version: str = accelerate.__version__) -> None:
    """Raise ``RuntimeError`` (naming both versions) for a release not in :data:`SUPPORTED_ACCELERATE`."""
    if not version.startswith(SUPPORTED_ACCELERATE):
        raise RuntimeError(
            f"ftbridge's Accelerate integration relies on internals checked against accelerate "
            f"{', '.join(p + 'x' for p in SUPPORTED_ACCELERATE)}; found {version}. "
            "Install a supported release: pip install 'accelerate>=1.15,<1.16' (or pip install 'ftbridge[hf]')"
        )


class ReplicaGroupsScheduler(AcceleratedScheduler):
    """Accelerate's scheduler wrapper, stepping ``replica_groups`` times per optimizer step (plain DP on all ranks).

    Args:
        scheduler, optimizers, step_with_optimizer, split_batches: as for ``AcceleratedScheduler``.
        replica_groups: ``N``, the job's replica groups (>= 1); with slots, the slots (plain data parallelism's
            ranks are the slots times the group size).
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
    """Make a discarded step read as skipped: set the optimizer's ``overflow`` flag on a discard.

    ``engine``: a ``DeepSpeedEngine`` with ftbridge attached. A commit leaves the flag as DeepSpeed set it.
    """
    optimizer = engine.optimizer

    def on_step(committed: bool) -> None:
        if not committed:
            optimizer.overflow = True

    engine.ftbridge.add_step_hook(on_step)


def sync_on_the_last_unit(units: Iterator[Unit], engine: Any, gradient_state: Any) -> Iterator[Unit]:
    """``units`` (``engine.ftbridge.units()``) with Accelerate's ``sync_gradients`` set for each one as DeepSpeed's
    accumulation boundary: true on the step's last unit only.

    ``accelerator.backward`` sets the boundary from ``sync_gradients`` and steps the engine when it is true, and
    the prepared scheduler steps only then; with slots a step has as many units as the group computes, not
    ``gradient_accumulation_steps``. ``sync_gradients`` is true again when the iteration ends or is abandoned.

    Args:
        units: the engine's units of one step (:meth:`ftbridge.engine.FaultTolerantEngine.units`).
        engine: the ``DeepSpeedEngine`` they belong to.
        gradient_state: Accelerate's ``GradientState`` (the accelerator's ``gradient_state``).
    """
    try:
        for unit in units:
            gradient_state._set_sync_gradients(bool(engine.is_gradient_accumulation_boundary()))
            yield unit
    finally:
        gradient_state._set_sync_gradients(True)


def settings_refusal(accelerator: Any) -> Optional[str]:
    """Why ftbridge cannot make ``accelerator``'s settings (an ``Accelerator``'s attributes) exact, or ``None``."""
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

    Args:
        ft_config: ftbridge settings (keyword-only, as the rest); default ``FTBridgeConfig.resolve()``.
        checksum_every, comm_hook, manager_factory: see :class:`ftbridge.engine.FaultTolerantEngine`.

    Raises:
        ValueError: settings that cannot be exact (:func:`settings_refusal`).
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

    def units(self) -> Iterator[Unit]:
        """The units of the current optimizer step (:meth:`ftbridge.engine.FaultTolerantEngine.units`); run one
        forward and ``backward`` on each unit's rows, then ``optimizer.step()`` and ``scheduler.step()`` as usual.

        ``sync_gradients`` is true on the step's last unit only (:func:`sync_on_the_last_unit`). With slots
        (``FTBRIDGE_SLOTS``) the group also computes the units of absent groups, and the step trains on the rows
        of the failure-free run: read them with ``UnitSampler.for_engine(model, len(dataset))``. Without slots
        the units are the group's own micro-batches (a warning says so once, on group rank 0).

        Raises:
            ValueError: the model is not prepared yet.
            RuntimeError: called inside a step (a forward ran since the last optimizer step).
        """
        if self.ft_engine is None:
            raise ValueError("prepare the model first (accelerator.prepare(model, optimizer, ...)), then loop over "
                             "accelerator.units()")
        controller = self.ft_engine.ftbridge
        if not controller.cfg.slots and not getattr(self, "_ft_told_no_slots", False):
            self._ft_told_no_slots = True
            if controller.cfg.group_rank == 0:
                logger.warning("accelerator.units() with slots off: each replica group computes its own "
                               "micro-batches only, and a step without a group trains without its rows; set "
                               "FTBRIDGE_SLOTS=%d (ftbridge-run --slots %d) for the same model whatever fails",
                               controller.cfg.num_replica_groups, controller.cfg.num_replica_groups)
        return sync_on_the_last_unit(controller.units(), self.ft_engine, self.gradient_state)

    def accumulate(self, *models: Any) -> Any:
        """``Accelerator.accumulate``.

        Raises:
            ValueError: with slots: :meth:`units` sets each unit's boundary, which ``accumulate`` would count again.
        """
        if self.ft_config.slots:
            raise ValueError(f"slots={self.ft_config.slots}: accelerator.units() sets the accumulation boundary of "
                             "each unit; drop accelerator.accumulate(...) from the loop")
        return super().accumulate(*models)

    def shard_across_replica_groups(self, loader: Any) -> Any:
        """The prepared training ``loader`` re-sharded across replica groups, to use in its place
        (:func:`ftbridge.integrations.accelerate_data.shard_across_replica_groups`; not for evaluation loaders).

        Raises:
            ValueError: the model is not prepared yet, slots are on (each unit's rows come from a
                ``UnitSampler``), or a loader that cannot be re-sharded exactly.
        """
        if self.ft_engine is None:
            raise ValueError("prepare the model first (accelerator.prepare(model, optimizer, ...)), then shard the "
                             "training loader: a warm spare learns which replica group it trains as there")
        if self.ft_config.slots:
            raise ValueError(f"slots={self.ft_config.slots}: a group reads the rows of whichever units it computes, "
                             "not a shard; loop over accelerator.units() and read each unit's rows with "
                             "ftbridge.slots.data.UnitSampler.for_engine(model, len(dataset)).indices(unit)")
        cfg = self.ft_engine.ftbridge.cfg
        out = accelerate_data.shard_across_replica_groups(
            loader, num_replica_groups=cfg.num_replica_groups, replica_group_id=cfg.replica_group_id,
            group_size=cfg.group_size, group_rank=cfg.group_rank)
        self._dataloaders = [out if d is loader else d for d in self._dataloaders]
        return out

    def save_state(self, output_dir: Optional[str] = None, safe_serialization: bool = True,
                   **save_model_func_kwargs: Any) -> Optional[str]:
        """``Accelerator.save_state``, written by replica group 0 and sealed before ``total_limit`` deletes any.

        Returns:
            The folder written, on replica group 0; ``None`` on the others, which only count the save.

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
        """``Accelerator.load_state`` of a whole checkpoint: by default the newest sealed ``checkpoint_<n>``.

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
        # The random generators too (dropout, a collator's masking), as the donor's forward started from them.
        engine.ftbridge.register_state("rng", rng.state_dict, rng.load_state_dict, at_step_start=True)
        mark_discarded_steps(engine)
        self.ft_engine = engine
        self.ft_config = engine.ftbridge.cfg  # a warm spare's: the replica group it took over

    def _per_job(self, prepared: AcceleratedScheduler) -> ReplicaGroupsScheduler:
        """``prepared`` as a :class:`ReplicaGroupsScheduler`, in Accelerate's list too, its state in every heal."""
        if self.ft_engine is None:
            raise ValueError("a scheduler was prepared before the model: prepare the model, optimizer and "
                             "scheduler in one call, accelerator.prepare(model, optimizer, loader, scheduler)")
        cfg = self.ft_engine.ftbridge.cfg
        out = ReplicaGroupsScheduler(prepared.scheduler, prepared.optimizers,
                                     replica_groups=cfg.slots or cfg.num_replica_groups,
                                     step_with_optimizer=prepared.step_with_optimizer,
                                     split_batches=prepared.split_batches)
        out._is_accelerate_prepared = True  # as Accelerate marks what it prepared
        self._schedulers = [out if s is prepared else s for s in self._schedulers]
        key = f"accelerate_scheduler_{sum(isinstance(s, ReplicaGroupsScheduler) for s in self._schedulers) - 1}"
        self.ft_engine.ftbridge.register_state(key, out.state_dict, out.load_state_dict)
        return out
