"""Plain, fp16 and bf16 averaging of a flat gradient partition across replica groups.

Follows PyTorch's ``ddp_comm_hooks/default_hooks.py`` (``allreduce_hook``,
``fp16_compress_hook``, ``bf16_compress_hook``, ``fp16_compress_wrapper``,
``bf16_compress_wrapper``), with the managed, fault-tolerant all-reduce of
:class:`ftbridge.comm_hooks.base.CommHookState` in place of a process group.

Each reduces through :meth:`ftbridge.comm_hooks.base.CommHookState.allreduce`,
whose ``divisor`` is the participating replica groups (or 1 under DeepSpeed's
``gradient_allreduce_op: sum``).

* ``allreduce_hook``: the sum, then divided, in the partition's dtype:
  torchft's average, and ftbridge's path without a hook.
* ``fp16_compress_hook`` / ``bf16_compress_hook``: divide in the partition's
  own dtype *first*, then cast and sum. PyTorch casts first; dividing first
  means a gradient that fits fp32 but not fp16 (up to 65504 x participants)
  still arrives finite. Half the bytes of fp32. fp16
  keeps 11 significant bits (relative error 2^-11 per cast, values under
  6e-5 lose precision, under 6e-8 flush to zero); bf16 keeps fp32's range
  and 8 significant bits (relative error up to 2^-8 per element).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ftbridge.comm_hooks.base import CastBackWork, CommHookState

Hook = Callable[[Any, torch.Tensor], Any]


def allreduce_hook(state: CommHookState, tensor: torch.Tensor) -> Any:
    """Average ``tensor`` in place over the participating replica groups (no compression).

    Args:
        state: the rank's hook state (its manager's all-reduce).
        tensor: flat gradient partition, any float dtype; summed, then divided, in that dtype.

    Returns:
        Work; after ``wait()`` ``tensor`` holds the average.
    """
    return state.allreduce(tensor, divide_first=False)


def _compress_hook(dtype: torch.dtype, state: CommHookState, tensor: torch.Tensor) -> Any:
    low = tensor.div(state.divisor).to(dtype)
    state.lend(low)
    return CastBackWork(state.allreduce(low, average=False), low, tensor)


def fp16_compress_hook(state: CommHookState, tensor: torch.Tensor) -> Any:
    """Average ``tensor`` with an fp16 payload (divide by the divisor, cast, sum, cast back).

    Args:
        state: the rank's hook state.
        tensor: flat gradient partition (fp32 or bf16).

    Returns:
        Work; after ``wait()`` ``tensor`` holds the average, rounded through fp16.
    """
    return _compress_hook(torch.float16, state, tensor)


def bf16_compress_hook(state: CommHookState, tensor: torch.Tensor) -> Any:
    """Average ``tensor`` with a bf16 payload (divide, cast, sum, cast back).

    Args:
        state: the rank's hook state.
        tensor: flat gradient partition (fp32).

    Returns:
        Work; after ``wait()`` ``tensor`` holds the average, rounded through bf16.
    """
    return _compress_hook(torch.bfloat16, state, tensor)


def _compress_wrapper(dtype: torch.dtype, hook: Hook) -> Hook:
    def wrapped(state: CommHookState, tensor: torch.Tensor) -> Any:
        low = tensor.to(dtype)
        if low is not tensor:
            state.lend(low)
        return CastBackWork(hook(state, low), low, tensor)

    wrapped.__name__ = f"{dtype_name(dtype)}_compress_wrapper({getattr(hook, '__name__', 'hook')})"
    wrapped.__wrapped__ = hook  # type: ignore[attr-defined]
    return wrapped


def fp16_compress_wrapper(hook: Hook) -> Hook:
    """Run ``hook`` on an fp16 copy of the partition and cast the result back.

    ``fp16_compress_wrapper(powerSGD_hook)`` sends PowerSGD's P and Q (and
    its uncompressed elements) in fp16: half their bytes again. Inside, the
    averages of fp16 tensors divide before they sum
    (:meth:`CommHookState.allreduce`).
    """
    return _compress_wrapper(torch.float16, hook)


def bf16_compress_wrapper(hook: Hook) -> Hook:
    """Run ``hook`` on a bf16 copy of the partition and cast the result back."""
    return _compress_wrapper(torch.bfloat16, hook)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``fp16``, ``torch.bfloat16`` -> ``bf16``."""
    return {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, str(dtype))
