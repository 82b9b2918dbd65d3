"""Cross-replica all-reduce for ZeRO optimizer CPU offload, inside backward.

With ``zero_optimization.offload_optimizer`` DeepSpeed does not keep the
reduced gradient partition until ``step()``: during backward, right after a
bucket has been reduced inside the replica group, it computes each
parameter's gradient norm (``norm_for_param_grads``, later summed into the
clip norm), records overflow (``local_overflow``), and copies the partition
into the fp32 buffer of the CPU optimizer (ZeRO-1/2:
``copy_grads_in_partition`` -> ``set_norm_for_param_grad_in_gpu``,
``async_inplace_copy_grad_to_fp32_buffer_from_gpu``, and, with gradient
accumulation, ``async_accumulate_grad_in_cpu_via_gpu`` on every micro-step;
ZeRO-3: ``partition_grads`` -> ``_offload_grad_partition_at_boundary``).
Averaging the partition after backward, as :mod:`ftbridge.zero.grad_sync` does,
is too late: each replica would clip by its own norm and step on its own
gradient. So :class:`OffloadSync` averages each bucket across replica groups
*before* DeepSpeed reads it, wrapping on the optimizer *instance* (deepspeed
0.19.8; DeepSpeed PR #7764's ``set_all_reduce_hook`` would have been this
hook point):

* ZeRO-1/2: ``DeepSpeedZeroOptimizer.average_tensor(tensor, dtype)``, after
  it returns: ``tensor`` is the reduced bucket (or one oversized gradient);
  the slices of this rank's partition are correct, the rest is never read.
  Only those slices are all-reduced (:func:`own_slices`), then
  ``reduce_ipg_grads`` copies them on.
* ZeRO-3: ``DeepSpeedZeroOptimizer_Stage3.partition_grads(params,
  grad_partitions)``, before the original: the bucket's reduced partitions
  are averaged, then DeepSpeed accumulates and offloads them.

Every all-reduce is synchronous (DeepSpeed reads the bucket right after) and
runs on *every* micro-step, not only at the accumulation boundary: stage 2
and 3 fold each micro-step into their accumulators (on the CPU for stage 2)
before the boundary, and averaging is linear, so averaging each micro-step's
bucket averages the accumulated sum. Stage 1 reduces only at the boundary,
on the summed gradient. The cost: ``gradient_accumulation_steps`` times the
per-step bytes under stages 2 and 3, and no overlap with backward.

Both ``sync_mode`` values take this path under offload (post-backward is too
late by construction); ``post_backward`` logs why. Elementwise
communication hooks (``no``, ``fp16``, ``bf16``, user hooks) run on each
bucket; a hook that needs the whole partition (PowerSGD) is refused.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist

from ftbridge.comm_hooks.base import CommHookState
from ftbridge.guard import gather_rows
from ftbridge.zero.grad_sync import HookedAllreduce
from ftbridge.manager import ReplicaManager
from ftbridge.zero.stages import Stage3Adapter, ZeroAdapter

logger = logging.getLogger(__name__)


class OffloadSync(HookedAllreduce):
    """Synchronous cross-replica all-reduce of each reduced bucket, for optimizer offload.

    Args:
        manager: the rank's replica manager.
        adapter: the engine's ZeRO adapter (``adapter.offload`` true).
        hook, hook_state: the communication hook (see :class:`ftbridge.zero.grad_sync.HookedAllreduce`).

    Raises:
        ValueError: a hook that needs the whole partition (PowerSGD), or the
            compact fp32 gradient path of bf16/fp16 parameters under ZeRO-1/2,
            naming what to change.
    """

    fallback_reason = ""

    def __init__(self, manager: ReplicaManager, adapter: ZeroAdapter,
                 hook: Optional[Callable[..., Any]] = None, hook_state: Optional[CommHookState] = None) -> None:
        super().__init__(manager, hook, hook_state)
        self.adapter = adapter
        self.issued_in_backward = 0
        self._layout = hashlib.blake2b(digest_size=6)
        if self.hook_state.needs_partition:
            raise ValueError(
                f"communication hook {getattr(self.hook, '__name__', self.hook)} needs the whole gradient "
                "partition, but with zero_optimization.offload_optimizer DeepSpeed consumes the partition bucket "
                "by bucket during backward: use comm_hook 'no', 'fp16' or 'bf16', or remove offload_optimizer")
        opt = adapter.optimizer
        if not isinstance(adapter, Stage3Adapter) and any(
                opt._use_compact_grad_partition_buffer(i) for i in range(len(opt.bit16_groups))):
            raise ValueError(
                "zero_optimization.offload_optimizer with bf16/fp16 parameters and fp32 gradient accumulation "
                "(DeepSpeed's compact gradient partition) is not supported by ftbridge: remove "
                "data_types.grad_accum_dtype (accumulate in the parameter dtype) or remove offload_optimizer")

    def install(self) -> None:
        """Wrap the optimizer's per-bucket method on the instance."""
        opt = self.adapter.optimizer
        if isinstance(self.adapter, Stage3Adapter):
            opt.partition_grads = self._stage3_wrapper(opt.partition_grads)
            name = "partition_grads"
        else:
            opt.average_tensor = self._stage12_wrapper(opt.average_tensor)
            name = "average_tensor"
        logger.info("optimizer offload: synchronous cross-replica all-reduce installed on %s.%s, every micro-step",
                    type(opt).__name__, name)

    def _stage12_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        opt = self.adapter.optimizer

        def average_tensor(tensor: torch.Tensor, communication_data_type: torch.dtype, *args: Any,
                           **kwargs: Any) -> Any:
            out = original(tensor, communication_data_type, *args, **kwargs)
            side = getattr(opt, "reduction_stream", None) if opt.overlap_comm and tensor.is_cuda else None
            if side is not None:  # overlap_comm reduced on DeepSpeed's side stream: wait for it, and back
                torch.cuda.current_stream().wait_stream(side)
            self._record_layout([pid for _, _, pid in opt.ipg_buckets[communication_data_type].params])
            self._average_now(own_slices(opt, tensor, communication_data_type))
            if side is not None:
                side.wait_stream(torch.cuda.current_stream())
            return out

        return average_tensor

    def _stage3_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def partition_grads(params: List[Any], grad_partitions: List[torch.Tensor]) -> Any:
            self._record_layout([int(p.ds_id) for p in params])
            self._average_now(list(grad_partitions))
            return original(params, grad_partitions)

        return partition_grads

    def _average_now(self, tensors: List[torch.Tensor]) -> None:
        """Average ``tensors`` in place across replica groups and wait (failures discard the step)."""
        if not self.enabled:
            return
        tensors = [t for t in tensors if t.numel() > 0]
        if not tensors:
            return
        if len(tensors) == 1 and tensors[0].is_contiguous():
            self._start(tensors[0].view(-1))
        else:
            self._start(torch.cat([t.reshape(-1) for t in tensors]), tensors)
        self.issued_in_backward += 1
        self._wait_pending(_scatter_back)

    def _record_layout(self, keys: List[int]) -> None:
        self._layout.update(len(keys).to_bytes(4, "little"))
        self._layout.update(b"".join(int(k).to_bytes(8, "little", signed=True) for k in keys))

    def begin_backward(self, *, first: bool = True, **_: Any) -> None:
        """A new window starts a new record of which parameters each bucket held."""
        if first:
            self._layout = hashlib.blake2b(digest_size=6)

    def end_backward(self, **_: Any) -> None:
        """Nothing left to send after backward."""

    def wait(self) -> None:
        """At the optimizer step: check every replica's buckets held the same parameters, in the same order.

        Raises:
            RuntimeError: they did not (data-dependent parameter use: MoE
                experts, branches, task heads), so the per-bucket averages
                paired different parameters; raised on every replica, before
                any optimizer step.
        """
        self._wait_pending(_scatter_back)
        if not self.enabled:
            return
        mine = float(int.from_bytes(self._layout.digest(), "little") + 1)  # 48 bits: exact in float64
        seen = {v for v in gather_rows(self.manager, [mine]).view(-1).tolist() if v}
        if len(seen) > 1:
            raise RuntimeError(
                "zero_optimization.offload_optimizer averages each bucket as DeepSpeed reduces it, but the "
                "replica groups' buckets held different parameters this step (a model whose parameter use "
                "depends on the data: MoE experts, branches, task heads). The averages paired different "
                "parameters, so no group steps on them. Remove offload_optimizer for this model (without it "
                "ftbridge's messages are fixed by the parameter layout)")


def _scatter_back(flat: torch.Tensor, targets: List[torch.Tensor]) -> None:
    offset = 0
    for t in targets:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view_as(t))
        offset += n


def own_slices(opt: Any, tensor: torch.Tensor, communication_data_type: torch.dtype) -> List[torch.Tensor]:
    """The slices of a ZeRO-1/2 bucket ``tensor`` that belong to this rank's partition, merged when adjacent.

    Mirrors the layout ``DeepSpeedZeroOptimizer.average_tensor`` (deepspeed 0.19.8) reduces by: the
    bucket's parameters back to back in ``ipg_buckets[dtype].params`` order, each split at
    ``grad_start_offset[group][partition][param]``. Only these slices are read after the call (the
    rest are other ranks' and are dropped). Falls back to the whole tensor when the layout is not
    the plain one (MoE buckets, all-reduce instead of reduce-scatter) or does not add up.

    Returns:
        1-D views of ``tensor`` (``tensor`` itself on fallback).
    """
    bucket = opt.ipg_buckets[communication_data_type]
    if bucket.has_moe_params or not opt.reduce_scatter or tensor.dim() != 1:
        return [tensor]
    me = dist.get_rank(group=opt.dp_process_group)
    ranges: List[List[int]] = []
    offset = 0
    for group_idx, idx_in_group, param_id in bucket.params:
        numel = opt.bit16_groups[group_idx][idx_in_group].numel()
        starts = opt.grad_start_offset[group_idx]
        owners = opt.param_to_partition_ids[group_idx][param_id]
        if me in owners:
            start = int(starts[me][param_id])
            after = [int(starts[p][param_id]) for p in owners if int(starts[p][param_id]) > start]
            end = min(after) if after else numel
            if ranges and ranges[-1][1] == offset + start:
                ranges[-1][1] = offset + end
            else:
                ranges.append([offset + start, offset + end])
        offset += numel
    if offset != tensor.numel():
        return [tensor]
    return [tensor.narrow(0, a, b - a) for a, b in ranges if b > a]
