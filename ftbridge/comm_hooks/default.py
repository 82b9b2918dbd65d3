"""Plain, fp16 and bf16 averaging of a flat gradient partition across replica groups.

PyTorch's ``ddp_comm_hooks/default_hooks.py``, reducing through :meth:`.base.CommHookState.allreduce` instead of
a process group. Unlike PyTorch, the fp16
and bf16 hooks divide by ``state.divisor`` in the partition's own dtype *before* the cast, so a gradient that
fits fp32 but not fp16 (up to 65504 x participants) arrives finite. Precision and bytes: docs/comm_hooks.md.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ftbridge.comm_hooks.base import CastBackWork, CommHookState

Hook = Callable[[Any, torch.Tensor], Any]


def allreduce_hook(state: CommHookState, tensor: torch.Tensor) -> Any:
    """Average ``tensor`` (flat gradient partition, any float dtype) in place: summed, then divided, in its dtype.

    Returns:
        Work; after ``wait()`` ``tensor`` holds the average.
    """
    return state.allreduce(tensor, divide_first=False)


def _compress_hook(dtype: torch.dtype, state: CommHookState, tensor: torch.Tensor) -> Any:
    low = tensor.div(state.divisor).to(dtype)
    state.lend(low)
    return CastBackWork(state.allreduce(low, average=False), low, tensor)


def fp16_compress_hook(state: CommHookState, tensor: torch.Tensor) -> Any:
    """Average ``tensor`` (flat fp32 or bf16 gradient partition) with an fp16 payload: divide, cast, sum, cast back.

    Returns:
        Work; after ``wait()`` ``tensor`` holds the average, rounded through fp16.
    """
    return _compress_hook(torch.float16, state, tensor)


def bf16_compress_hook(state: CommHookState, tensor: torch.Tensor) -> Any:
    """Average ``tensor`` (flat fp32 gradient partition) with a bf16 payload: divide, cast, sum, cast back.

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
    """Run ``hook`` on an fp16 copy of the partition and cast the result back (PowerSGD's messages in fp16)."""
    return _compress_wrapper(torch.float16, hook)


def bf16_compress_wrapper(hook: Hook) -> Hook:
    """Run ``hook`` on a bf16 copy of the partition and cast the result back."""
    return _compress_wrapper(torch.bfloat16, hook)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``fp16``, ``torch.bfloat16`` -> ``bf16``."""
    return {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, str(dtype))
