"""Per-ZeRO-stage access to DeepSpeed's optimizer internals (:class:`Stage12Adapter`,
:class:`Stage3Adapter`, :class:`BF16OptimizerAdapter`; :func:`adapter_for` picks one).

The one place that knows DeepSpeed's attributes, for the versions in
:data:`ftbridge.zero.engine_points.SUPPORTED_DEEPSPEED`; everything else goes through
:class:`ftbridge.zero.adapter.ZeroAdapter`. The gradient partition at the boundary:

* ZeRO-1/2: ``averaged_gradients[g]`` (views plus zero pads, or one flat fp32
  ``flat_partition`` on the compact path); under optimizer offload the CPU fp32
  ``single_partition_of_fp32_groups[g].grad``;
* ZeRO-3: ``grad_partitions_flat_buffer``, with or without offload;
* ``BF16_Optimizer``: ``fp32_groups_gradients_flat[g]``, the *full* flat gradient.

Under offload, :meth:`ZeroAdapter.begin_window`, :meth:`ZeroAdapter.assemble_partition`
and :meth:`ZeroAdapter.prepare_step` make the partition exact and redo the norms and
overflow flag from the average; :meth:`ZeroAdapter.discard_grads` also resets what
DeepSpeed's ``step()`` resets there. Why: docs/concepts.md, "Where the sync sits in a
ZeRO step" and "Optimizer offload".
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Tuple

import deepspeed
import torch

from ftbridge.zero.adapter import ZeroAdapter, with_optimizer_state
from ftbridge.zero.layout import PartitionLayout, stage3_layout, stage12_layout

logger = logging.getLogger(__name__)

class Stage12Adapter(ZeroAdapter):
    """ZeRO stage 1 and 2 (``DeepSpeedZeroOptimizer``)."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.stage = engine.zero_optimization_stage()

    def partition_grads(self) -> List[torch.Tensor]:
        if self.offload:  # what step() reads under offload: the CPU fp32 partition's .grad
            self.optimizer._wait_for_offload_copies()
            return [p.grad for p in self.optimizer.single_partition_of_fp32_groups]
        out: List[torch.Tensor] = []
        for group_idx in sorted(self.optimizer.averaged_gradients):
            grads = self.optimizer.averaged_gradients[group_idx]
            if grads is None:
                continue
            flat = getattr(grads, "flat_partition", None)
            out.extend([flat] if flat is not None else list(grads))
        return out

    def discard_grads(self) -> None:
        opt = self.optimizer
        opt.zero_grad(set_to_none=True)
        release = getattr(opt, "_release_preflattened_grad_buffers", None)
        if release is not None:
            release()
        for k in list(opt.averaged_gradients):
            opt.averaged_gradients[k] = None
            opt.all_grad_tensors[k] = None
        # step() resets the id so the next window overwrites, not accumulates.
        opt.micro_step_id = -1
        if self.offload:
            # What step() resets under offload: per-parameter norms and the overflow flag computed in
            # backward, and the window's active parameters. accumulated_grads_in_cpu and the fp32
            # partition's .grad are overwritten (not added to) by the next window, as after a step.
            opt._wait_for_offload_copies()
            opt.reset_cpu_buffers()
            opt._offload_accumulated_param_ids = set()

    def partition_numel(self) -> int:
        return sum(int(n) for n in self.optimizer.partition_size)

    def _read_layout(self) -> PartitionLayout:
        return stage12_layout(self.optimizer)

    @property
    def compact_grad_partition(self) -> bool:
        opt = self.optimizer
        return any(opt._use_compact_grad_partition_buffer(i) for i in range(len(opt.bit16_groups)))

    def unsupported(self) -> str:
        if self.offload and self.compact_grad_partition:
            return ("zero_optimization.offload_optimizer with bf16/fp16 parameters and fp32 gradient accumulation "
                    "(DeepSpeed's compact gradient partition) is not supported by ftbridge: remove "
                    "data_types.grad_accum_dtype (accumulate in the parameter dtype) or remove offload_optimizer")
        return ""

    def grad_dtype(self) -> torch.dtype:
        if self.offload:
            return self.optimizer.single_partition_of_fp32_groups[0].dtype
        return getattr(self.optimizer, "gradient_accumulation_dtype", None) or self.optimizer.dtype

    def per_bucket_unsupported(self, layout: Any) -> str:
        opt = self.optimizer
        if self.offload:
            return "optimizer offload under ZeRO-1/2 (DeepSpeed assembles the partition on the CPU)"
        if self.compact_grad_partition:
            return "compact fp32 gradient accumulation of bf16/fp16 parameters"
        if self.grad_dtype() != opt.dtype:
            return f"gradient accumulation dtype {self.grad_dtype()} differs from parameter dtype {opt.dtype}"
        return super().per_bucket_unsupported(layout)

    def accumulation_refused(self) -> str:
        if self.stage == 1 and getattr(self.optimizer, "overlap_comm", False):
            # Measured (deepspeed 0.19.8, 2 ranks): a parameter used only before the last micro-batch of the
            # step keeps its local gradient, never averaged inside the group (7.8e-5 off the torch reference
            # in one SGD step); without overlap_comm, or under ZeRO-2, it matches to 3e-9.
            return ("ZeRO-1 with zero_optimization.overlap_comm true and several backward calls per optimizer "
                    "step: DeepSpeed 0.19 then never reduces inside the replica group the gradient of a "
                    "parameter used only before the last backward. Set overlap_comm to false (ZeRO-1 reduces "
                    "once per step anyway) or use ZeRO stage 2")
        return ""

    def window_not_exact(self, first: bool) -> str:
        # DeepSpeed sums the micro-steps into all_grad_tensors in the epilogue, after the last bucket.
        return "" if first else ("several backward calls in one optimizer step under ZeRO-1/2 (DeepSpeed sums "
                                 "them after the last bucket)")

    def wrap_bucket_point(self, on_reduced: Callable[[List[int]], None]) -> None:
        # DeepSpeedZeroOptimizer.reduce_ipg_grads: after it returns, the reduced gradients of the bucket's
        # parameters are in param.grad (a view into grads_in_partition with contiguous_gradients).
        opt = self.optimizer
        original = opt.reduce_ipg_grads

        def reduce_ipg_grads(comm_dtype: Any = None, *args: Any, **kwargs: Any) -> Any:
            buckets = [opt.ipg_buckets[comm_dtype]] if comm_dtype is not None else list(opt.ipg_buckets.values())
            keys = [param_id for b in buckets for _, _, param_id in b.params]
            out = original(comm_dtype, *args, **kwargs)
            if keys:
                on_reduced(keys)
            return out

        opt.reduce_ipg_grads = reduce_ipg_grads
        self._param_of = {opt.get_param_id(p): p for group in opt.bit16_groups for p in group}

    def bucket_stream(self) -> Any:
        # reduce_ipg_grads reduced (and copied into the partition) on reduction_stream with overlap_comm,
        # else on the current stream.
        opt = self.optimizer
        return getattr(opt, "reduction_stream", None) if getattr(opt, "overlap_comm", False) else None

    def gather_reduced(self, message: Any) -> Tuple[torch.Tensor, bool]:
        opt = self.optimizer
        params = [self._param_of[f.key] for f in message.fragments]
        device = params[0].device if params else torch.device("cpu")
        flat = torch.zeros(message.numel, dtype=self.grad_dtype(), device=device)
        for f, p in zip(message.fragments, params):
            grad = opt.get_param_gradient_attribute(p)
            if grad is not None:
                at = f.offset - message.start
                flat[at:at + f.numel].copy_(grad.reshape(-1)[f.param_start:f.param_start + f.numel])
        return flat, True

    def begin_window(self) -> None:
        if not self.offload:
            return
        opt = self.optimizer
        opt._wait_for_offload_copies()
        for p in opt.single_partition_of_fp32_groups:
            p.grad.zero_()
        for buf in opt.accumulated_grads_in_cpu.values():
            buf.zero_()

    def assemble_partition(self) -> None:
        opt = self.optimizer
        if not self.offload or opt.low_precision_master_weights_and_grads:  # there: views of the partition
            return
        opt._wait_for_offload_copies()
        for pid in opt._offload_accumulated_param_ids:
            group_idx, source_offset, dest_offset, numel = opt.grad_position[pid]
            dest = opt.single_partition_of_fp32_groups[group_idx].grad.view(-1).narrow(0, dest_offset, numel)
            dest.copy_(opt.accumulated_grads_in_cpu[pid].view(-1).narrow(0, source_offset, numel))

    def prepare_step(self) -> None:
        if not self.offload:
            return
        from deepspeed.runtime.zero.utils import get_norm_dtype

        opt = self.optimizer
        overflow = False
        for group_idx, params in enumerate(opt.params_in_partition):
            grad = opt.single_partition_of_fp32_groups[group_idx].grad.view(-1)
            overflow = overflow or bool(opt._has_inf_or_nan(grad))
            for p in params:
                pid = opt.get_param_id(p)
                _, _, dest_offset, numel = opt.grad_position[pid]
                opt.norm_for_param_grads[pid] = grad.narrow(0, dest_offset, numel).to(get_norm_dtype()).norm(2)
        opt.local_overflow = overflow

    def load_heal_state(self, state: Dict[str, Any]) -> None:
        self.optimizer.load_state_dict(self._state_list(state), load_optimizer_states=True,
                                       load_from_fp32_weights=True)
        # fp32 master partitions -> model parameters, all-gathered in the group.
        self.optimizer.update_lp_params()


class Stage3Adapter(ZeroAdapter):
    """ZeRO stage 3 (``DeepSpeedZeroOptimizer_Stage3``)."""

    stage = 3

    def partition_grads(self) -> List[torch.Tensor]:
        return [self.optimizer.grad_partitions_flat_buffer]

    def discard_grads(self) -> None:
        opt = self.optimizer
        opt.zero_grad(set_to_none=True)  # also resets micro_step_id to 0
        opt.averaged_gradients = {}
        if self.offload:
            # As step() does: per-parameter norms from backward and the window's active parameters.
            # The fp32 partition's .grad is overwritten at the next boundary.
            opt.reset_cpu_buffers()
            opt._offload_boundary_param_ids = set()

    def partition_numel(self) -> int:
        return int(self.optimizer.grad_partitions_flat_buffer.numel())

    def _read_layout(self) -> PartitionLayout:
        return stage3_layout(self.optimizer)

    def grad_dtype(self) -> torch.dtype:
        return self.optimizer.grad_partitions_flat_buffer.dtype

    def per_bucket_unsupported(self, layout: Any) -> str:
        if not hasattr(self.optimizer, "grad_partitions_flat_buffer"):
            return "ZeRO-3 optimizer without grad_partitions_flat_buffer"
        return super().per_bucket_unsupported(layout)

    def wrap_bucket_point(self, on_reduced: Callable[[List[int]], None]) -> None:
        # DeepSpeedZeroOptimizer_Stage3.partition_grads: after it returns, the bucket's reduced partitions
        # are accumulated in place in grad_partitions_flat_buffer, at offsets fixed per parameter.
        original = self.optimizer.partition_grads

        def partition_grads(params: List[Any], grad_partitions: List[torch.Tensor]) -> Any:
            out = original(params, grad_partitions)
            on_reduced([int(p.ds_id) for p in params])
            return out

        self.optimizer.partition_grads = partition_grads

    def bucket_stream(self) -> Any:
        # partition_grads runs inside DeepSpeed's `with stream(reduce_and_partition_stream)` block.
        return getattr(self.optimizer, "reduce_and_partition_stream", None)

    def gather_reduced(self, message: Any) -> Tuple[torch.Tensor, bool]:
        return self.optimizer.grad_partitions_flat_buffer.view(-1)[message.start:message.end], False

    def begin_window(self) -> None:
        # DeepSpeed copies a parameter's first gradient of a window into its slot and adds the later ones,
        # but never clears the slot of a parameter that gets no gradient: it would step on (and send) the
        # gradient of the last step that used it. Zero them all; used slots are overwritten anyway.
        self.optimizer.grad_partitions_flat_buffer.zero_()

    def prepare_step(self) -> None:
        # DeepSpeed offloaded each parameter's local gradient (and took its norm) at the boundary backward,
        # and never one that the boundary backward did not reduce: offload the averaged partition, all of it.
        if not self.offload:
            return
        opt = self.optimizer
        slots = opt._DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition
        grads: Dict[int, Any] = {}
        offsets: Dict[int, Any] = {}
        for group in opt.fp16_groups:
            for p in group:
                if p.partition_numel() * opt._get_param_partition_rank(p) < p.ds_numel:  # holds real data here
                    opt._offload_grad_partition_at_boundary(p, slots[p.ds_id], grads, offsets)
        opt._swap_out_offload_fp32_gradients(grads, offsets)
        # the copies to the CPU are non-blocking; the CPU optimizer reads next
        if opt.grad_partitions_flat_buffer.is_cuda:
            torch.cuda.current_stream().synchronize()

    def load_heal_state(self, state: Dict[str, Any]) -> None:
        opt = self.optimizer
        opt.checkpoint_event_prologue()
        opt.load_state_dict(self._state_list(state), load_optimizer_states=True, load_from_fp32_weights=True)
        opt.checkpoint_event_epilogue()

    def fingerprint_tensors(self) -> List[torch.Tensor]:
        # ZeRO-3 puts its fp32 partitions into the torch optimizer's param_groups only while it steps
        # them (_optimizer_step) and empties them again: read the partitions themselves.
        opt = self.optimizer
        return with_optimizer_state(opt.optimizer, list(opt.fp32_partitioned_groups_flat))

    def full_parameters(self) -> List[torch.Tensor]:
        params = list(self.engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            return [p.detach().clone() for p in params]


class BF16OptimizerAdapter(ZeroAdapter):
    """ZeRO-1 with bf16 parameters and fp32 gradient accumulation (``BF16_Optimizer``)."""

    stage = 1

    def partition_grads(self) -> List[torch.Tensor]:
        # The boundary micro-step is folded into these fp32 buffers (backward_epilogue or the
        # immediate_grad_update hooks) before the engine's in-group all-reduce of them
        # (deepspeed/runtime/engine.py _backward_epilogue), so after backward they hold the group average.
        return list(self.optimizer.fp32_groups_gradients_flat)

    def discard_grads(self) -> None:
        # What BF16_Optimizer.step does itself on an overflow: drop both gradient copies.
        self.optimizer.clear_hp_grads()
        self.optimizer.clear_lp_grads()

    def partition_numel(self) -> int:
        return sum(int(t.numel()) for t in self.optimizer.fp32_groups_gradients_flat)

    def grad_dtype(self) -> torch.dtype:
        return self.optimizer.fp32_groups_gradients_flat[0].dtype

    def partition_layout(self) -> PartitionLayout:
        return PartitionLayout(self.partition_numel())  # full flat gradients, no per-parameter fragments

    def per_bucket_unsupported(self, layout: Any) -> str:
        return "BF16_Optimizer reduces its full flat fp32 gradients after backward, not per bucket"

    def load_heal_state(self, state: Dict[str, Any]) -> None:
        self.optimizer.load_state_dict(self._state_list(state), load_optimizer_states=True,
                                       load_from_fp32_weights=True)
        # fp32 master partitions -> bf16 parameters, all-gathered in the group.
        self.optimizer.update_lp_params()


def adapter_for(engine: Any) -> ZeroAdapter:
    """Pick the adapter for ``engine``'s ZeRO stage and optimizer.

    Raises:
        ValueError: ZeRO stage 0, with what to change in the DeepSpeed config.
    """
    stage = engine.zero_optimization_stage()
    name = type(engine.optimizer).__name__
    if stage not in (1, 2, 3):
        raise ValueError(
            f"zero_optimization.stage={stage}: ftbridge shards optimizer state with ZeRO; "
            "set zero_optimization.stage to 1, 2 or 3 in the DeepSpeed config"
        )
    if name == "BF16_Optimizer":
        return BF16OptimizerAdapter(engine)
    if stage == 3:
        return Stage3Adapter(engine)
    return Stage12Adapter(engine)
