"""Per-bucket cross-replica all-reduce, installed into DeepSpeed from outside.

DeepSpeed has no hook that fires after a gradient bucket has been reduced
inside the data-parallel group. Its PR #7764 proposed one
(``set_all_reduce_hook``) and was closed unmerged; with it, this module would
be a single registration. Instead, for the DeepSpeed versions in
:data:`ftbridge.zero.stages.SUPPORTED_DEEPSPEED`, the smallest method that
sees a reduced bucket is wrapped on the optimizer *instance* (the class is
untouched):

* ZeRO-1/2: ``DeepSpeedZeroOptimizer.reduce_ipg_grads`` -- after it returns,
  the bucket's gradients sit, reduced inside the group, in the contiguous
  ``grads_in_partition`` buffer between the offsets it had before and after
  the call. That region is all-reduced across replica groups in place. It
  holds whole parameters that overlap this rank's partition, so at most the
  two parameters straddling the partition edges also send their
  out-of-partition elements (never read by ``step()``).
* ZeRO-3: ``DeepSpeedZeroOptimizer_Stage3.partition_grads`` -- after it
  returns, the bucket's reduced gradient partitions are in
  ``grad_partitions_flat_buffer`` (the returned views), accumulated over the
  micro-steps of the window. They are concatenated, all-reduced and copied
  back when :meth:`wait` runs.

Only at the gradient accumulation boundary: stage 2 (and 3) reduce every
micro-step, but the cross-replica all-reduce runs once per optimizer step, on
the accumulated gradient. Each all-reduce is asynchronous: backward goes on
computing the next buckets while gloo/NCCL send this one. :meth:`wait` runs
in ``engine.step()`` before DeepSpeed's overflow check, norm and clipping.

Unsupported layouts fall back to the post-backward all-reduce with a
warning, because there the partition is assembled after the hook point:
ZeRO-1/2 with ``gradient_accumulation_steps > 1`` (DeepSpeed sums the
micro-steps into ``all_grad_tensors`` in the epilogue, after the last bucket),
the compact fp32-accumulation path for bf16/fp16 parameters,
``contiguous_gradients: false``, and a gradient accumulation dtype different
from the parameters'. ZeRO-3 accumulates in place and has no such limit.
A communication hook that needs the whole partition and its fragment layout
(PowerSGD, :mod:`ftbridge.comm_hooks.powersgd`) also selects the
post-backward all-reduce; elementwise hooks (``no``, ``fp16``, ``bf16``, and
user hooks by default) run on each coalesced message.

Under ``zero_optimization.offload_optimizer`` neither this hook nor the
post-backward all-reduce is used: DeepSpeed consumes each bucket during
backward there, and :mod:`ftbridge.zero.offload_hook` averages it first.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, List, Optional

import torch

from ftbridge.grad_sync import PostBackwardSync
from ftbridge.manager import ReplicaManager
from ftbridge.zero.stages import BF16OptimizerAdapter, Stage3Adapter, ZeroAdapter

logger = logging.getLogger(__name__)


class PerBucketSync(PostBackwardSync):
    """Cross-replica all-reduce of each reduced ZeRO bucket, overlapped with backward.

    Reduced buckets are coalesced until ``min_bytes`` are ready before one
    cross-replica all-reduce is issued (as DDP's ``bucket_cap_mb`` decouples
    its messages from the layers): DeepSpeed's in-group bucket size is tuned
    for the fast in-group link, while every cross-replica call costs a fixed
    overhead on the slow one. Adjacent regions of one buffer are merged into
    one view, so no copy is made for ZeRO-1/2.

    Args:
        manager: the rank's replica manager.
        adapter: the engine's ZeRO adapter.
        is_boundary: returns whether the current micro-step is the
            gradient accumulation boundary (the engine's own test).
        min_bytes: smallest cross-replica message, bytes; the remainder is
            sent when backward ends.
        hook, hook_state: the communication hook (see :class:`PostBackwardSync`).
    """

    def __init__(self, manager: ReplicaManager, adapter: ZeroAdapter, is_boundary: Callable[[], bool],
                 min_bytes: int = 25 << 20, hook: Optional[Callable[..., Any]] = None,
                 hook_state: Optional[Any] = None) -> None:
        super().__init__(manager, adapter, hook, hook_state)
        self.is_boundary = is_boundary
        self.min_bytes = min_bytes
        self.fallback_reason = unsupported_reason(adapter)
        if self.hook_state.needs_partition and not self.fallback_reason:
            self.fallback_reason = (f"communication hook {getattr(self.hook, '__name__', self.hook)} needs the "
                                    "whole partition and its fragment layout")
        self._open: List[torch.Tensor] = []
        self._open_bytes = 0

    def install(self) -> None:
        """Wrap the optimizer's per-bucket method (or log the fallback)."""
        super().install()
        if self.fallback_reason:
            logger.warning("per-bucket cross-replica sync unavailable (%s); using one post-backward all-reduce",
                           self.fallback_reason)
            return
        opt = self.adapter.optimizer
        name = "partition_grads" if isinstance(self.adapter, Stage3Adapter) else "reduce_ipg_grads"
        original = getattr(opt, name)
        wrapper = self._stage3_wrapper(original) if name == "partition_grads" else self._stage12_wrapper(original)
        setattr(opt, name, wrapper)
        logger.info("per-bucket cross-replica all-reduce installed on %s.%s", type(opt).__name__, name)

    def _stage12_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        opt = self.adapter.optimizer

        def reduce_ipg_grads(*args: Any, **kwargs: Any) -> Any:
            before = opt.grads_in_partition_offset if opt.grads_in_partition is not None else 0
            out = original(*args, **kwargs)
            if self.enabled and self.is_boundary() and opt.grads_in_partition is not None:
                after = opt.grads_in_partition_offset
                if after > before:
                    self._add([opt.grads_in_partition.view(-1).narrow(0, before, after - before)])
            return out

        return reduce_ipg_grads

    def _stage3_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def partition_grads(params: List[Any], grad_partitions: List[torch.Tensor]) -> Any:
            buffers = original(params, grad_partitions)
            if self.enabled and self.is_boundary() and buffers:
                self._add(list(buffers))
            return buffers

        return partition_grads

    def _add(self, tensors: List[torch.Tensor]) -> None:
        for t in tensors:
            if t.numel() == 0:
                continue
            last = self._open[-1] if self._open else None
            if last is not None and _adjacent(last, t):
                self._open[-1] = last.new_empty(0).set_(last.untyped_storage(), last.storage_offset(),
                                                        (last.numel() + t.numel(),))
            else:
                self._open.append(t.view(-1))
            self._open_bytes += t.numel() * t.element_size()
        if self._open_bytes >= self.min_bytes:
            self._flush()

    def _flush(self) -> None:
        if self._open:
            self._issue(self._open)
        self._open, self._open_bytes = [], 0

    def on_boundary_backward(self) -> None:
        """Send what is left after the last bucket (or, in fallback, the whole partition)."""
        if self.fallback_reason:
            super().on_boundary_backward()
        else:
            self._flush()

    def reset(self) -> None:
        """Forget pending and coalescing work (after a discarded step)."""
        super().reset()
        self._open, self._open_bytes = [], 0


def _adjacent(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``b`` starts where 1-D contiguous ``a`` ends, in the same storage and dtype."""
    return (a.dtype == b.dtype and a.is_contiguous() and b.is_contiguous()
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and b.storage_offset() == a.storage_offset() + a.numel())


def unsupported_reason(adapter: ZeroAdapter) -> str:
    """Why the per-bucket hook cannot run on this optimizer, or ``""`` if it can."""
    opt = adapter.optimizer
    if isinstance(adapter, BF16OptimizerAdapter):
        return "BF16_Optimizer reduces its full flat fp32 gradients after backward, not per bucket"
    if isinstance(adapter, Stage3Adapter):
        if not hasattr(opt, "grad_partitions_flat_buffer"):
            return "ZeRO-3 optimizer without grad_partitions_flat_buffer"
        return ""
    if adapter.engine.gradient_accumulation_steps() > 1:
        # ZeRO-1/2 sum the micro-steps into all_grad_tensors in the epilogue, after the last bucket
        # was reduced: at the bucket hook the boundary bucket holds only the last micro-step.
        return "gradient_accumulation_steps > 1 under ZeRO-1/2 (micro-steps are summed after the last bucket)"
    if not getattr(opt, "contiguous_gradients", False):
        return "zero_optimization.contiguous_gradients is false"
    if any(opt._use_compact_grad_partition_buffer(i) for i in range(len(opt.bit16_groups))):
        return "compact fp32 gradient accumulation of bf16/fp16 parameters"
    accum = getattr(opt, "gradient_accumulation_dtype", opt.dtype)
    if accum != opt.dtype:
        return f"gradient accumulation dtype {accum} differs from parameter dtype {opt.dtype}"
    return ""
