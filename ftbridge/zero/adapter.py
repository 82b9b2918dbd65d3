"""The interface every ZeRO stage's adapter implements: :class:`ZeroAdapter`.

ftbridge reaches DeepSpeed's optimizer internals only through it; the stages in :mod:`ftbridge.zero.stages`.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist

from ftbridge.zero.layout import PartitionLayout
from ftbridge.zero.state import from_wire, to_wire

logger = logging.getLogger(__name__)


class ZeroAdapter:
    """Stage-specific operations on a DeepSpeed engine's ZeRO optimizer.

    Args:
        engine: an initialised ``deepspeed.DeepSpeedEngine`` with ZeRO stage 1, 2 or 3.
    """

    stage: int = 0

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.optimizer = engine.optimizer

    @property
    def offload(self) -> bool:
        """Whether ``zero_optimization.offload_optimizer`` moved the optimizer (and the fp32 partition) to the CPU."""
        opt = self.optimizer
        return bool(getattr(opt, "cpu_offload", False) or getattr(opt, "offload_optimizer", False))

    # -- gradients -------------------------------------------------------
    def partition_grads(self) -> List[torch.Tensor]:
        """This rank's reduced gradient partition, the tensors ``optimizer.step()`` reads (1-D or views; in place)."""
        raise NotImplementedError

    def discard_grads(self) -> None:
        """Drop the step's gradients; optimizer, scaler and counters stay as they are."""
        raise NotImplementedError

    def discard_window(self) -> None:
        """Drop a discarded step's gradients, and its micro-batches from DeepSpeed's unmanaged sample count."""
        self.discard_grads()
        if hasattr(self.engine, "_unmanaged_backward_count"):  # managed_gradient_accumulation: false
            self.engine._unmanaged_backward_count = 0

    # -- the cross-replica message plan (ftbridge.zero.grad_sync) -----------
    def partition_numel(self) -> int:
        """Elements of :meth:`partition_grads` concatenated (known from init on)."""
        raise NotImplementedError

    def grad_dtype(self) -> torch.dtype:
        """dtype of the partition ``optimizer.step()`` reads."""
        raise NotImplementedError

    def grad_element_size(self) -> int:
        """Bytes per element of :meth:`grad_dtype`."""
        return torch.empty((), dtype=self.grad_dtype()).element_size()

    def partition_layout(self) -> PartitionLayout:
        """The fragments of each parameter in the partition; unreadable: one fragment-less layout (sent whole)."""
        try:
            return self._read_layout()
        except ValueError as e:
            logger.warning("partition layout unavailable (%s): the partition travels as one message", e)
            return PartitionLayout(self.partition_numel())

    def _read_layout(self) -> PartitionLayout:
        raise ValueError(f"no partition layout reader for {type(self.optimizer).__name__}")

    @property
    def compact_grad_partition(self) -> bool:
        """DeepSpeed's compact path: bf16/fp16 parameters, fp32 gradients written straight into one flat
        partition during the in-group reduction (ZeRO-1/2, deepspeed 0.19)."""
        return False

    def unsupported(self) -> str:
        """Why ftbridge cannot keep replicas exact with this optimizer at all, or ``""``."""
        return ""

    def per_bucket_unsupported(self, layout: PartitionLayout) -> str:
        """Why the gradient of a reduced bucket is never the final partition here, or ``""``."""
        if layout.numel and not layout.fragments:
            return "the partition layout could not be read"
        return ""

    def window_not_exact(self, first: bool) -> str:
        """Why per-bucket issue is not exact for a boundary backward (``first``: the window's only one), or ``""``."""
        return ""

    def accumulation_refused(self) -> str:
        """Why DeepSpeed itself cannot accumulate several backward calls per optimizer step here, or ``""``."""
        return ""

    def wrap_bucket_point(self, on_reduced: Callable[[List[int]], None]) -> None:
        """Call ``on_reduced(param_keys)`` each time DeepSpeed has reduced a bucket inside the group."""
        raise NotImplementedError

    def gather_reduced(self, message: Any) -> Tuple[torch.Tensor, bool]:
        """During the boundary backward: ``(message's reduced elements as 1-D, zero-padded; is it a copy)``."""
        raise NotImplementedError

    def begin_window(self) -> None:
        """Before the first backward of an optimizer step (nothing to do for most stages)."""

    def assemble_partition(self) -> None:
        """Before the sync reads :meth:`partition_grads` whole: complete what DeepSpeed left (ZeRO-1/2 offload)."""

    def prepare_step(self) -> None:
        """After the cross-replica average, before DeepSpeed's step: redo what backward derived from the
        local gradient (under offload: the CPU fp32 copy, per-parameter norms, overflow); nothing elsewhere."""

    @property
    def on_cuda(self) -> bool:
        """The model (so the gradient partition, offload aside) is on a GPU."""
        return any(p.is_cuda for p in self.engine.module.parameters())

    def side_streams(self) -> List[Any]:
        """DeepSpeed's CUDA side streams that write gradient buffers (``[]`` on CPU)."""
        from ftbridge.zero.stream_order import side_streams

        return side_streams(self.optimizer)

    def bucket_stream(self) -> Any:
        """At the bucket point: the CUDA stream that reduced the bucket just handed over (``None``: the current one)."""
        return None

    # -- state -----------------------------------------------------------
    def heal_state(self) -> Dict[str, Any]:
        """Optimizer state of this rank as a nested dict of tensors and JSON scalars."""
        return to_wire(self.optimizer.state_dict())

    def load_heal_state(self, state: Dict[str, Any]) -> None:
        """Load a peer's :meth:`heal_state` (same group rank); collective: every rank of the group calls it.

        Raises:
            ValueError: the peer's state does not match this rank's shapes.
        """
        raise NotImplementedError

    def fingerprint_tensors(self) -> List[torch.Tensor]:
        """For the divergence guard: the wrapped optimizer's fp32 master partitions, each with its state tensors."""
        return with_optimizer_state(self.optimizer.optimizer,
                           [p for group in self.optimizer.optimizer.param_groups for p in group["params"]])

    def full_parameters(self) -> List[torch.Tensor]:
        """The module's full parameters, for checksums (gathered under ZeRO-3: collective in the group)."""
        return [p.detach() for p in self.engine.module.parameters()]

    def _state_list(self, state: Dict[str, Any]) -> List[Any]:
        merged = from_wire(self.optimizer.state_dict(), state)
        group = self.optimizer.dp_process_group
        slots: List[Any] = [None] * dist.get_world_size(group=group)
        slots[dist.get_rank(group=group)] = merged
        return slots


def with_optimizer_state(base: torch.optim.Optimizer, masters: List[torch.Tensor]) -> List[torch.Tensor]:
    """Each master tensor followed by its optimizer state tensors (in key order), detached."""
    out: List[torch.Tensor] = []
    for p in masters:
        out.append(p.detach())
        state = base.state.get(p, {})
        out.extend(v.detach() for _, v in sorted(state.items()) if torch.is_tensor(v))
    return out

