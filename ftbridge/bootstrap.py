"""From a model and a DeepSpeed config to a running fault-tolerant engine: :func:`initialize`.

Checks everything that can be checked before any work (the ftbridge settings
and their timeout hierarchy, the DeepSpeed version, the ZeRO stage, fp16
support, the device placement, the torch.distributed world against the
replica group size), then runs ``deepspeed.initialize``, lets a warm spare
stand by until it takes over a dead group's id (:mod:`ftbridge.spare`), and
wraps the DeepSpeed engine in :class:`ftbridge.engine.FaultTolerantEngine`.
``ftbridge.initialize`` is this module's :func:`initialize`.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, Optional, Tuple

import deepspeed
import torch
import torch.distributed as dist

from ftbridge import device
from ftbridge.build_lock import prepare_jit_build
from ftbridge.config import FTBridgeConfig
from ftbridge.engine import FaultTolerantEngine
from ftbridge.manager import ReplicaManager
from ftbridge.zero.engine_points import check_deepspeed_version


def initialize(*, model: torch.nn.Module, config: Any, ft_config: Optional[FTBridgeConfig] = None,
               checksum_every: Optional[int] = None, comm_hook: Optional[Callable[..., Any]] = None,
               manager_factory: Optional[Callable[..., ReplicaManager]] = None,
               **kwargs: Any) -> Tuple[FaultTolerantEngine, Any, Any, Any]:
    """``deepspeed.initialize`` for one replica group of a fault-tolerant job.

    Args:
        model: the module (identically initialised on every replica group,
            unless ``ft_config.init_sync``).
        config: the DeepSpeed config (dict or JSON path), ZeRO stage 1, 2 or 3.
            An ``"ftbridge"`` section (``comm_hook``, ``comm_wrapper``,
            ``comm_state_option``, or any other :class:`FTBridgeConfig` field)
            is removed before DeepSpeed sees the config and overrides the
            environment (an explicit ``ft_config`` wins over both).
        ft_config: ftbridge settings; resolved from the environment when ``None``. With
            ``spare_index >= 0`` this call returns only once the spare has taken over a dead
            group's id (:func:`ftbridge.spare.stand_by`); read ``engine.cfg.replica_group_id``
            (the data shard) after it, not before.
        checksum_every: see :class:`FaultTolerantEngine`.
        comm_hook: a user communication hook, see :class:`FaultTolerantEngine`.
        manager_factory: see :class:`FaultTolerantEngine` (default: torchft through
            :class:`ftbridge.manager.ReplicaManager`).
        **kwargs: passed to ``deepspeed.initialize`` (``optimizer``,
            ``model_parameters``, ``lr_scheduler``, ``training_data`` ...).

    Returns:
        ``(engine, optimizer, training_dataloader, lr_scheduler)`` like DeepSpeed,
        with ``engine`` a :class:`FaultTolerantEngine`.

    Raises:
        SystemExit: (status 0) a spare (``spare_index >= 0``) whose job ended while it stood by.
        ValueError: bad ftbridge settings, ZeRO stage 0, an unsupported
            optimizer path, a device setup that cannot work
            (:func:`ftbridge.device.check_placement`: the model on a GPU under
            ``DS_ACCELERATOR=cpu``, no GPU for this rank, NCCL across ranks that
            share a GPU), or a torch.distributed world whose size is not the
            replica group size — all before the engine is built where possible.
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
    where, group_backend, _ = device.check_placement({p.device.type for p in model.parameters()},
                                                     get_accelerator().device_name(), cfg)
    if where != "cpu":
        torch.cuda.set_device(torch.device(where))  # NCCL (in-group, cross-replica) uses the current device
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend=group_backend, timeout=cfg.in_group_timeout)
    if dist.get_world_size() != cfg.group_size or dist.get_rank() != cfg.group_rank:
        raise ValueError(
            f"torch.distributed world is rank {dist.get_rank()} of {dist.get_world_size()} but ftbridge expects "
            f"group rank {cfg.group_rank} of a replica group of {cfg.group_size}: each replica group must be "
            "its own world (launch each group with its own ftbridge-run / torchrun)"
        )
    engine, optimizer, loader, scheduler = deepspeed.initialize(model=model, config=config, **kwargs)
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
                                    manager_factory=manager_factory)
    if takeover is not None:
        ft_engine.events.write(**takeover.event())
    return ft_engine, optimizer, loader, scheduler


def split_ds_config(config: Any) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """The DeepSpeed config (dict or JSON path) without its ``"ftbridge"`` section, and that section.

    Raises:
        ValueError: the section is not a JSON object.
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

