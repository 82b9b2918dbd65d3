"""Communication hooks for the cross-replica all-reduce of ZeRO gradient partitions.

The hooks, names and options of PyTorch DDP's communication hooks and of Accelerate's
``DistributedDataParallelKwargs(comm_hook=..., comm_wrapper=..., comm_state_option=...)``: ``no`` (the
default), ``fp16`` and ``bf16`` (:mod:`.default`), ``power_sgd`` and ``batched_power_sgd`` (:mod:`.powersgd`);
``comm_wrapper`` casts around a PowerSGD hook; ``comm_state_option`` holds PowerSGD's options
(:data:`POWER_SGD_DEFAULTS`). A hook is any callable ``hook(state, tensor) -> work`` averaging ``tensor`` (the
rank's flat gradient partition, or a region of it) in place through ``state``
(:class:`~ftbridge.comm_hooks.base.CommHookState`). Choosing a hook, its cost and the fault-tolerance rules:
docs/comm_hooks.md. This module imports no torch (the launcher reads the names and validation).
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Dict, Mapping, Optional


class DDPCommunicationHookType(str, enum.Enum):
    """Built-in hooks, with Accelerate's names and values."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


POWER_SGD_HOOKS = (DDPCommunicationHookType.POWER_SGD, DDPCommunicationHookType.BATCHED_POWER_SGD)
WRAPPERS = (DDPCommunicationHookType.NO, DDPCommunicationHookType.FP16, DDPCommunicationHookType.BF16)

POWER_SGD_DEFAULTS: Dict[str, Any] = {
    "matrix_approximation_rank": 1,
    "start_powerSGD_iter": 1_000,
    "min_compression_rate": 2.0,
    "use_error_feedback": True,
    "warm_start": True,
    "orthogonalization_epsilon": 0.0,
    "random_seed": 0,
    "batch_tensors_with_same_shape": False,
}
"""``comm_state_option`` keys and defaults: those of PyTorch's ``PowerSGDState``."""

_OPTION_TYPES = {"matrix_approximation_rank": int, "start_powerSGD_iter": int, "min_compression_rate": float,
                 "use_error_feedback": bool, "warm_start": bool, "orthogonalization_epsilon": float,
                 "random_seed": int, "batch_tensors_with_same_shape": bool}


def hook_type(value: Any, what: str = "comm_hook") -> DDPCommunicationHookType:
    """``value`` (an enum member or its name/value, any case) as a hook type.

    Raises:
        ValueError: naming the value and the valid names.
    """
    if isinstance(value, DDPCommunicationHookType):
        return value
    text = str(value).strip().lower()
    for member in DDPCommunicationHookType:
        if text in (member.value, member.name.lower()):
            return member
    raise ValueError(f"{what}={value!r} is not a communication hook; use one of "
                     f"{[m.value for m in DDPCommunicationHookType]}")


def resolve_state_option(options: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """PowerSGD options: ``options`` over :data:`POWER_SGD_DEFAULTS`, type-checked.

    Raises:
        ValueError: an unknown key, a wrong type, or a value out of range, naming the fix.
    """
    out = dict(POWER_SGD_DEFAULTS)
    for key, value in dict(options or {}).items():
        if key not in _OPTION_TYPES:
            raise ValueError(f"comm_state_option key {key!r} is unknown; valid keys are {sorted(_OPTION_TYPES)} "
                             "(PyTorch's PowerSGDState names)")
        kind = _OPTION_TYPES[key]
        if kind is bool and not isinstance(value, bool):
            raise ValueError(f"comm_state_option {key}={value!r} must be true or false")
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"comm_state_option {key}={value!r} must be an integer")
        if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"comm_state_option {key}={value!r} must be a number")
        out[key] = kind(value)
    if out["matrix_approximation_rank"] < 1:
        raise ValueError(f"comm_state_option matrix_approximation_rank={out['matrix_approximation_rank']} "
                         "must be at least 1")
    if out["start_powerSGD_iter"] < 0:
        raise ValueError(f"comm_state_option start_powerSGD_iter={out['start_powerSGD_iter']} must be >= 0")
    if out["min_compression_rate"] < 0:
        raise ValueError(f"comm_state_option min_compression_rate={out['min_compression_rate']} must be >= 0")
    if out["orthogonalization_epsilon"] < 0:
        raise ValueError(f"comm_state_option orthogonalization_epsilon={out['orthogonalization_epsilon']} "
                         "must be >= 0 (1e-8 guards against all-zero gradient columns)")
    return out


def validate(comm_hook: Any, comm_wrapper: Any = "no", comm_state_option: Optional[Mapping[str, Any]] = None) -> None:
    """Check a hook choice at the configuration boundary.

    Raises:
        ValueError: an unknown hook or wrapper, a wrapper on a hook that is not PowerSGD, or a bad
            ``comm_state_option``, naming the fix.
    """
    hook = hook_type(comm_hook)
    wrapper = hook_type(comm_wrapper, "comm_wrapper")
    if wrapper not in WRAPPERS:
        raise ValueError(f"comm_wrapper={comm_wrapper!r} must be one of {[w.value for w in WRAPPERS]}")
    if wrapper is not DDPCommunicationHookType.NO and hook not in POWER_SGD_HOOKS:
        raise ValueError(f"comm_wrapper={wrapper.value!r} wraps a PowerSGD hook, not comm_hook={hook.value!r}; "
                         f"use comm_hook={wrapper.value!r} instead, or comm_hook='power_sgd'")
    if comm_state_option and hook not in POWER_SGD_HOOKS:
        raise ValueError(f"comm_state_option is for power_sgd/batched_power_sgd, not comm_hook={hook.value!r}; "
                         "remove it or choose a PowerSGD hook")
    resolve_state_option(comm_state_option)


def build(comm_hook: Any = "no", comm_wrapper: Any = "no", comm_state_option: Optional[Mapping[str, Any]] = None,
          manager: Any = None, reduction: str = "mean"):
    """The ``(hook, state)`` pair for a built-in hook or a user callable.

    Args:
        comm_hook: a :class:`DDPCommunicationHookType` (or its value), or a user's callable
            ``hook(state, tensor) -> work`` (with ``hook.needs_partition = True`` it gets the whole partition
            after backward and ``state.layout``, like PowerSGD).
        comm_wrapper: ``no``, ``fp16`` or ``bf16`` cast around a PowerSGD hook.
        comm_state_option: PowerSGD options (:data:`POWER_SGD_DEFAULTS`).
        manager: the rank's :class:`ftbridge.manager.ReplicaManager`.
        reduction: ``"mean"`` or ``"sum"``, the engine's ``gradient_allreduce_op``.

    Returns:
        ``(hook, state)``; ``state`` is a ``PowerSGDState`` for PowerSGD hooks, else a ``CommHookState``.

    Raises:
        ValueError: see :func:`validate`.
    """
    from ftbridge.comm_hooks import default, powersgd
    from ftbridge.comm_hooks.base import CommHookState

    if callable(comm_hook) and not isinstance(comm_hook, (str, DDPCommunicationHookType)):
        state = CommHookState(manager, reduction)
        # A user hook that needs the whole partition and its layout sets ``hook.needs_partition = True``.
        state.needs_partition = bool(getattr(comm_hook, "needs_partition", False))
        return comm_hook, state
    validate(comm_hook, comm_wrapper, comm_state_option)
    kind, wrapper = hook_type(comm_hook), hook_type(comm_wrapper, "comm_wrapper")
    if kind in POWER_SGD_HOOKS:
        state = powersgd.PowerSGDState(manager, reduction=reduction,
                                       batched=kind is DDPCommunicationHookType.BATCHED_POWER_SGD,
                                       **resolve_state_option(comm_state_option))
        hook: Callable[..., Any] = powersgd.batched_powerSGD_hook if state.batched else powersgd.powerSGD_hook
        if wrapper is DDPCommunicationHookType.FP16:
            hook = default.fp16_compress_wrapper(hook)
        elif wrapper is DDPCommunicationHookType.BF16:
            hook = default.bf16_compress_wrapper(hook)
        return hook, state
    hooks = {DDPCommunicationHookType.NO: default.allreduce_hook,
             DDPCommunicationHookType.FP16: default.fp16_compress_hook,
             DDPCommunicationHookType.BF16: default.bf16_compress_hook}
    return hooks[kind], CommHookState(manager, reduction)


__all__ = ["DDPCommunicationHookType", "POWER_SGD_DEFAULTS", "build", "hook_type", "resolve_state_option",
           "validate"]
