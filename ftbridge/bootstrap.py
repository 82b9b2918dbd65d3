"""From a model and a DeepSpeed config to a running fault-tolerant engine.

:func:`initialize` (``ftbridge.initialize``) wraps ``deepspeed.initialize`` in a
:class:`ftbridge.engine.FaultTolerantEngine`; :func:`attach` (``ftbridge.attach``) makes an engine a
framework built fault-tolerant in place. Both let a warm spare stand by first (:mod:`ftbridge.spare`).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, Optional, Tuple

import deepspeed
import torch
import torch.distributed as dist

from ftbridge import device
from ftbridge.config import FTBridgeConfig
from ftbridge.engine import FaultTolerantEngine
from ftbridge.launch.build_lock import prepare_jit_build
from ftbridge.manager import ReplicaManager
from ftbridge.zero.engine_points import check_deepspeed_version


def initialize(*, model: torch.nn.Module, config: Any, ft_config: Optional[FTBridgeConfig] = None,
               checksum_every: Optional[int] = None, comm_hook: Optional[Callable[..., Any]] = None,
               manager_factory: Optional[Callable[..., ReplicaManager]] = None,
               **kwargs: Any) -> Tuple[FaultTolerantEngine, Any, Any, Any]:
    """``deepspeed.initialize`` for one replica group of a fault-tolerant job.

    Args:
        model: the module, identically initialised on every replica group (same seed everywhere).
        config: the DeepSpeed config (dict or JSON path), ZeRO stage 1, 2 or 3. Its ``"ftbridge"``
            section (any :class:`FTBridgeConfig` field) is removed before DeepSpeed sees it and
            overrides the environment; ``ft_config`` wins over both.
        ft_config: ftbridge settings; resolved from the environment when ``None``. A spare
            (``spare_index >= 0``) returns only once it took over a dead group's id: read
            ``engine.cfg.replica_group_id`` (the data shard) after this call.
        checksum_every, comm_hook, manager_factory: see :class:`FaultTolerantEngine`.
        **kwargs: passed to ``deepspeed.initialize`` (``optimizer``, ``model_parameters`` ...).

    Returns:
        ``(engine, optimizer, training_dataloader, lr_scheduler)`` like DeepSpeed, with ``engine``
        a :class:`FaultTolerantEngine`.

    Raises:
        SystemExit: (status 0) a spare whose job ended while it stood by.
        ValueError: bad ftbridge settings, ZeRO stage 0, an unsupported optimizer path, a placement that
            cannot work (:func:`ftbridge.device.check_placement`), or a world that is not one replica group.
        RuntimeError: an untested DeepSpeed version.
    """
    prepare_jit_build()
    if ft_config is None and not dist.is_initialized() and not {"RANK", "WORLD_SIZE", "MASTER_ADDR"} <= set(os.environ):
        raise ValueError(
            "RANK, WORLD_SIZE and MASTER_ADDR are not set: launch each replica group with ftbridge-run "
            "(or torchrun), e.g. ftbridge-run --replica-group-id 0 --num-replica-groups 2 --nproc-per-node 2 "
            "-- train.py"
        )
    config, section = split_ds_config(config)
    cfg = ft_config if ft_config is not None else FTBridgeConfig.resolve(**section)
    cfg.validate()
    check_deepspeed_version()
    check_ds_config(config)
    where, group_backend = check_placement(model, cfg)
    if where != "cpu":
        torch.cuda.set_device(torch.device(where))  # NCCL (in-group, cross-replica) uses the current device
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend=group_backend, timeout=cfg.in_group_timeout)
    check_world(cfg)
    engine, optimizer, loader, scheduler = deepspeed.initialize(model=model, config=config, **kwargs)
    ft_engine = control(engine, cfg, checksum_every=checksum_every, comm_hook=comm_hook,
                        manager_factory=manager_factory)
    return ft_engine, optimizer, loader, scheduler


def attach(engine: Any, *, ft_config: Optional[FTBridgeConfig] = None, checksum_every: Optional[int] = None,
           comm_hook: Optional[Callable[..., Any]] = None,
           manager_factory: Optional[Callable[..., ReplicaManager]] = None) -> Any:
    """Make a ``deepspeed.DeepSpeedEngine`` that someone else built fault-tolerant, in place.

    For frameworks that call ``deepspeed.initialize`` themselves (:mod:`ftbridge.integrations.accelerate`).
    Installs the controller's ``forward``, ``backward`` and ``step`` on the instance; ``type(engine)`` is
    unchanged and the controller is ``engine.ftbridge``.

    Args:
        engine: a ``DeepSpeedEngine`` whose world is one replica group, before its first training step.
        ft_config: ftbridge settings; default: the environment and the ``"ftbridge"`` section of a dict
            ``engine.config``. A spare's are replaced by the group's it takes over (``engine.ftbridge.cfg``).
        checksum_every, comm_hook, manager_factory: as for :class:`FaultTolerantEngine`.

    Returns:
        ``engine`` itself.

    Raises:
        TypeError: ``engine`` is not a ``DeepSpeedEngine``.
        ValueError: attached already, a model-parallel unit (``mpu``), or as :func:`initialize`.
        RuntimeError: an untested DeepSpeed version.
        SystemExit: (status 0) a spare whose job ended while it stood by.
    """
    if not isinstance(engine, deepspeed.DeepSpeedEngine):
        raise TypeError(f"ftbridge.attach takes a deepspeed.DeepSpeedEngine, got {type(engine).__name__}")
    if isinstance(engine.__dict__.get("ftbridge"), FaultTolerantEngine):
        raise ValueError("ftbridge is already attached to this engine (engine.ftbridge): attach it once")
    prepare_jit_build()
    config, section = split_ds_config(engine.config) if isinstance(engine.config, (dict, str)) else ({}, {})
    cfg = ft_config if ft_config is not None else FTBridgeConfig.resolve(**section)
    cfg.validate()
    check_deepspeed_version()
    check_ds_config({**config, "zero_optimization": {"stage": engine.zero_optimization_stage()},
                     "fp16": {"enabled": bool(engine.fp16_enabled())}})
    check_placement(engine.module, cfg)
    if getattr(engine, "mpu", None) is not None or int(getattr(engine, "autotp_size", lambda: 0)() or 0) > 1:
        raise ValueError("the engine has a model-parallel unit (mpu: tensor, sequence or AutoTP parallelism): "
                         "ftbridge needs every rank of a replica group to be a data-parallel rank; remove the "
                         "model or sequence parallelism")
    check_world(cfg)
    controller = control(engine, cfg, in_place=True, checksum_every=checksum_every, comm_hook=comm_hook,
                         manager_factory=manager_factory)
    # Plain instance attributes: nn.Module keeps non-Module values in __dict__, which the attribute lookup
    # reads before the class; torch's Module.__call__ calls self.forward, so engine(batch) reaches the
    # controller too, with the module hooks of the engine around it as before.
    engine.forward, engine.backward, engine.step = controller.forward, controller.backward, controller.step
    engine.ftbridge = controller
    return engine


def check_ds_config(config: Dict[str, Any]) -> None:
    """Raise ``ValueError`` (naming the fix) for ZeRO stage 0, or fp16 where the device has none."""
    from deepspeed.accelerator import get_accelerator

    stage = int(config.get("zero_optimization", {}).get("stage", 0))
    if dict(config.get("fp16") or {}).get("enabled") is True:
        accel = get_accelerator()
        if not accel.is_fp16_supported():
            raise ValueError(f"fp16.enabled is true but this {accel.device_name()} device has no fp16 support in "
                             "DeepSpeed's accelerator (on CPU: AVX-512 FP16 or AMX-FP16); use bf16.enabled instead, "
                             "or run on a device with fp16")
    if stage not in (1, 2, 3):
        raise ValueError(f"zero_optimization.stage={stage}: set it to 1, 2 or 3 in the DeepSpeed config")


def check_placement(model: torch.nn.Module, cfg: FTBridgeConfig) -> Tuple[str, str]:
    """``(device, in-group backend)`` of ``model``, e.g. ``("cuda:1", "nccl")``.

    Raises ``ValueError`` as :func:`ftbridge.device.check_placement`.
    """
    from deepspeed.accelerator import get_accelerator

    where, group_backend, _ = device.check_placement({p.device.type for p in model.parameters()},
                                                     get_accelerator().device_name(), cfg)
    return where, group_backend


def check_world(cfg: FTBridgeConfig) -> None:
    """Raise ``ValueError`` when the world's size or this rank differ from ``cfg.group_size`` / ``cfg.group_rank``."""
    if dist.get_world_size() != cfg.group_size or dist.get_rank() != cfg.group_rank:
        raise ValueError(
            f"torch.distributed world is rank {dist.get_rank()} of {dist.get_world_size()} but ftbridge expects "
            f"group rank {cfg.group_rank} of a replica group of {cfg.group_size}: each replica group must be "
            "its own world (launch each group with its own ftbridge-run / torchrun)"
        )


def control(engine: Any, cfg: FTBridgeConfig, *, in_place: bool = False, checksum_every: Optional[int] = None,
            comm_hook: Optional[Callable[..., Any]] = None,
            manager_factory: Optional[Callable[..., ReplicaManager]] = None) -> FaultTolerantEngine:
    """The controller of a built engine; a spare stands by first (``SystemExit(0)`` if its job ends meanwhile)."""
    takeover = None
    if cfg.num_replica_groups > 1:  # warm spares (ftbridge.spare): ready, they wait here, outside the quorum
        from ftbridge import IMPORTED_AT, spare

        cfg = spare.demote_if_taken(cfg, restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                                    imported_at=IMPORTED_AT)
        if cfg.spare_index >= 0:
            takeover = spare.stand_by(cfg)
            cfg = takeover.cfg
            # The launcher set this process's id (N + K for a spare, G for a demoted restart); from now on it
            # holds another, and code that identifies the process from the environment (ftbridge.faults'
            # fault points, a script's own logs) must see the id it trains as, like a cold restart of it would.
            os.environ["FTBRIDGE_REPLICA_GROUP_ID"] = os.environ["REPLICA_GROUP_ID"] = str(cfg.replica_group_id)
    ft_engine = FaultTolerantEngine(engine, cfg, checksum_every=checksum_every, comm_hook=comm_hook,
                                    manager_factory=manager_factory, in_place=in_place)
    if takeover is not None:
        ft_engine.events.write(**takeover.event())
    return ft_engine


def split_ds_config(config: Any) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """The DeepSpeed config (dict or JSON path) without its ``"ftbridge"`` section, and that section.

    Raises ``ValueError`` when the section is not a JSON object.
    """
    if isinstance(config, str):
        import json
        with open(config, encoding="utf-8") as f:
            config = json.load(f)
    config = dict(config)
    section = config.pop("ftbridge", None) or {}
    if not isinstance(section, dict):
        raise ValueError(f'DeepSpeed config "ftbridge" section is {section!r}; make it an object like '
                         '{"comm_hook": "power_sgd", "comm_state_option": {"matrix_approximation_rank": 2}}')
    return config, section

