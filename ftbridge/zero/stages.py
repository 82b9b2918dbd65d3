"""Per-ZeRO-stage access to DeepSpeed's optimizer internals.

DeepSpeed has no public API for "the gradient partition this rank is about
to step on", "drop this step's gradients", or "copy a peer's optimizer state
in memory". Each ZeRO stage keeps them in different attributes; this module
is the one place that knows where, for the DeepSpeed versions in
:data:`SUPPORTED_DEEPSPEED`. Everything else in ftbridge goes through
:class:`ZeroAdapter`.

Where the gradient partition lives at the accumulation boundary (deepspeed
0.19.8, no optimizer offload):

* ZeRO-1/2 (``DeepSpeedZeroOptimizer``): ``averaged_gradients[g]`` for each
  parameter group ``g``: a list of views plus zero pads, or, on the compact
  path (bf16/fp16 parameters, fp32 accumulation), an object holding one flat
  fp32 ``flat_partition``.
* ZeRO-3 (``DeepSpeedZeroOptimizer_Stage3``): one flat
  ``grad_partitions_flat_buffer`` for all groups.
* ``BF16_Optimizer`` (ZeRO-1 with bf16 parameters and fp32 gradient
  accumulation): ``fp32_groups_gradients_flat[g]``, the *full* flat fp32
  gradient of group ``g``, all-reduced in the group by the engine. Its step
  clips by a norm over all of it, so the whole flat gradient is averaged
  across replicas, not only the rank's partition (``group_size`` times the
  bytes of a ZeRO-1/2 partition).

With ``zero_optimization.offload_optimizer`` (:attr:`ZeroAdapter.offload`) the
gradient reaches the CPU fp32 partition's ``.grad`` during backward, and the
cross-replica average happens there (:mod:`ftbridge.zero.offload_hook`);
:meth:`ZeroAdapter.partition_grads` is then not what the sync reads.
:meth:`ZeroAdapter.discard_grads` also resets what DeepSpeed's ``step()``
resets on that path (``reset_cpu_buffers``: per-parameter norms and, for
ZeRO-1/2, ``local_overflow``).
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List

import deepspeed
import torch
import torch.distributed as dist

from ftbridge.zero.state import from_wire, to_wire

logger = logging.getLogger(__name__)

SUPPORTED_DEEPSPEED = ("0.19.",)
"""DeepSpeed release prefixes whose internals this module was checked against."""


def check_deepspeed_version(version: str = deepspeed.__version__) -> None:
    """Refuse a DeepSpeed release whose internals ftbridge has not been checked against.

    Raises:
        RuntimeError: naming the installed and the supported versions.
    """
    if not version.startswith(SUPPORTED_DEEPSPEED):
        raise RuntimeError(
            f"ftbridge patches DeepSpeed internals checked against deepspeed "
            f"{', '.join(p + 'x' for p in SUPPORTED_DEEPSPEED)}; found {version}. "
            "Install a supported release: pip install 'deepspeed>=0.19,<0.20'"
        )


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
        """This rank's reduced gradient partition at the accumulation boundary.

        Returns:
            Tensors that ``optimizer.step()`` reads, to be modified in place
            (dtype: DeepSpeed's gradient accumulation dtype; 1-D or views).
        """
        raise NotImplementedError

    def discard_grads(self) -> None:
        """Drop the step's gradients; optimizer, scaler and counters stay as they are."""
        raise NotImplementedError

    # -- state -----------------------------------------------------------
    def heal_state(self) -> Dict[str, Any]:
        """Optimizer state of this rank as a nested dict of tensors and JSON scalars."""
        return to_wire(self.optimizer.state_dict())

    def load_heal_state(self, state: Dict[str, Any]) -> None:
        """Load a peer's :meth:`heal_state` (same group rank, same shapes).

        Issues an all-gather inside the replica group: every rank of the
        group must call it at the same point.

        Raises:
            ValueError: the peer's state does not match this rank's shapes.
        """
        raise NotImplementedError

    def full_parameters(self) -> List[torch.Tensor]:
        """The module's full parameters (gathered under ZeRO-3), for checksums.

        Collective inside the replica group under ZeRO-3.
        """
        return [p.detach() for p in self.engine.module.parameters()]

    def _state_list(self, state: Dict[str, Any]) -> List[Any]:
        merged = from_wire(self.optimizer.state_dict(), state)
        group = self.optimizer.dp_process_group
        slots: List[Any] = [None] * dist.get_world_size(group=group)
        slots[dist.get_rank(group=group)] = merged
        return slots


class Stage12Adapter(ZeroAdapter):
    """ZeRO stage 1 and 2 (``DeepSpeedZeroOptimizer``)."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.stage = engine.zero_optimization_stage()

    def partition_grads(self) -> List[torch.Tensor]:
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

    def load_heal_state(self, state: Dict[str, Any]) -> None:
        opt = self.optimizer
        opt.checkpoint_event_prologue()
        opt.load_state_dict(self._state_list(state), load_optimizer_states=True, load_from_fp32_weights=True)
        opt.checkpoint_event_epilogue()

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
