"""What a communication hook sees: :class:`CommHookState` (DDP's ``process_group`` argument), whose
:meth:`~CommHookState.allreduce` scales and counts every cross-replica sum; stateful hooks subclass it.
Rules: docs/comm_hooks.md, "Fault tolerance: what changes from DDP".
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Union

import torch
from torch.distributed import ReduceOp

LOW_PRECISION = (torch.float16, torch.bfloat16)
REDUCTIONS = ("mean", "sum")
"""DeepSpeed's ``gradient_allreduce_op`` values, which the cross-replica reduction follows."""


class CommHookState:
    """The manager-backed process group of one rank, as a hook sees it.

    Args:
        manager: the rank's replica manager (``allreduce(tensor, reduce_op=...)``, ``participants``, ``current_step``).
        reduction: DeepSpeed's ``gradient_allreduce_op``, ``"mean"`` (groups averaged) or ``"sum"`` (summed):
            the result is plain DeepSpeed's over every data-parallel rank of the job.

    Raises:
        ValueError: ``reduction`` is not one of :data:`REDUCTIONS`.
    """

    needs_partition = False
    """True for hooks that need the whole partition and its layout (PowerSGD): sent after backward, not per bucket."""

    def __init__(self, manager: Any, reduction: str = "mean") -> None:
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction={reduction!r}: use one of {', '.join(REDUCTIONS)} "
                             "(DeepSpeed's gradient_allreduce_op)")
        self.manager = manager
        self.reduction = reduction
        self.slots = 0
        """The job's slots (:attr:`ftbridge.config.FTBridgeConfig.slots`), set by the engine; 0 for none."""
        self.layout: Any = None
        """The rank's :class:`ftbridge.zero.layout.PartitionLayout`, set by the gradient sync before the first step."""
        self.bytes_sent = 0
        """Bytes handed to the cross-replica all-reduce so far (payload, not wire bytes)."""
        self.allreduces = 0
        """Cross-replica all-reduce calls so far."""
        self.weight: Optional[float] = None
        """This group's weight in the current step's average (:meth:`set_weight`); ``None``: groups count alike."""
        self._weight_device: Union[str, torch.device] = "cpu"
        self._total_weight: Optional[float] = None

    # -- what hooks call ----------------------------------------------------
    @property
    def participants(self) -> int:
        """Replica groups taking part in this step (waits for the quorum)."""
        return int(self.manager.participants)

    @property
    def step(self) -> int:
        """Committed steps before this one, the same on every replica, a healing one too (waits for the quorum)."""
        self.participants  # noqa: B018  (waits for the quorum)
        return int(self.manager.current_step)

    @property
    def divisor(self) -> float:
        """Divisor of an average (waits for the quorum): :attr:`slots` if set, else participants; 1 for ``"sum"``.

        With a :attr:`weight`: the participants' summed weights over this group's (``inf`` for weight 0), which
        the group divides its own tensor by before the sum (:meth:`allreduce` does so): the sum is then
        ``sum_g weight_g * tensor_g / sum_g weight_g``. The first use in a step sums the weights (one
        all-reduce of one float64, waited for); a failure there is recorded and the step discarded.
        """
        if self.reduction != "mean":
            return 1
        if self.weight is not None:
            total = self._sum_weights()
            return math.inf if self.weight == 0 else total / self.weight
        return self.slots or self.participants

    def set_weight(self, weight: float, device: Union[str, torch.device] = "cpu") -> None:
        """Weight this group's gradient by ``weight`` in the current step's average across replica groups.

        For losses normalised by a count that differs between groups (label tokens of padded rows): each group
        passes its count, the same on every rank of the group, and the result is the count-weighted average,
        as plain data parallelism over every rank gets with the count summed over the job. Cleared when the
        step ends (:meth:`end_step`). ``device``: where the cross-replica all-reduce runs (the gradients').

        Raises:
            ValueError: ``weight`` negative or not finite; ``reduction="sum"``; a hook that reduces other
                tensors than the gradient (PowerSGD's factors cannot be weighted per group).
        """
        if not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight >= 0):
            raise ValueError(f"step weight {weight!r}: use a finite count >= 0 (e.g. the group's label tokens)")
        if self.reduction != "mean":
            raise ValueError("a step weight with gradient_allreduce_op 'sum': gradients are summed, not averaged; "
                             "drop the weight or use the default 'mean'")
        if self.needs_partition:
            raise ValueError(f"a step weight with a hook that reduces factors of its own ({type(self).__name__}, as "
                             "PowerSGD does): they cannot be weighted per group; use no hook, fp16 or bf16")
        self.weight, self._weight_device, self._total_weight = float(weight), device, None

    def end_step(self) -> None:
        """The step ended (committed or discarded): forget its weight."""
        self.weight = self._total_weight = None

    def _sum_weights(self) -> float:
        if self._total_weight is None:
            t = torch.tensor([self.weight], dtype=torch.float64, device=self._weight_device)
            self.count(t)
            try:
                ok = wait_result(self.manager.allreduce(t, reduce_op=ReduceOp.SUM), t)
            except Exception as e:  # noqa: BLE001 - recorded: the manager discards the step
                self.manager.report_error(e)
                ok = False
            self._total_weight = float(t[0]) if ok else math.nan
        return self._total_weight

    def allreduce(self, tensor: torch.Tensor, average: bool = True, divide_first: Optional[bool] = None) -> Any:
        """Start reducing ``tensor`` in place across replica groups: their sum, divided by :attr:`divisor`.

        Divides as torchft's ``AVG`` does (after the sum): bit-identical to its average by default.

        Args:
            tensor: contiguous floating point tensor, any shape.
            average: ``False`` sums without dividing.
            divide_first: divide before the sum; default ``True`` for fp16/bf16 (no overflow in the sum); always
                with a :attr:`weight`.

        Returns:
            Work whose ``wait()`` returns once ``tensor`` holds the result, or ``False`` (``tensor``
            undefined) when the all-reduce failed. A peer's failure is recorded by the manager, never raised.
        """
        self.count(tensor)
        divisor = self.divisor if average else 1
        if average and self.weight is not None:
            divide_first = True  # the weight scales each group's own tensor
        elif divide_first is None:
            divide_first = tensor.dtype in LOW_PRECISION
        if divide_first and divisor != 1:
            tensor.div_(divisor)
            divisor = 1
        work = self.manager.allreduce(tensor, reduce_op=ReduceOp.SUM)
        return work if divisor == 1 else DividedWork(work, tensor, divisor)

    def lend(self, tensor: torch.Tensor) -> None:
        """Declare ``tensor`` the hook's own buffer for its next all-reduce (the peer watch then copies nothing).

        Nothing else may touch it until that ``wait()`` returns; drop it when the wait fails. A manager without
        ``lend`` (:meth:`ftbridge.manager.ReplicaManager.lend`) ignores it.
        """
        lend = getattr(self.manager, "lend", None)
        if lend is not None:
            lend(tensor)

    def count(self, tensor: torch.Tensor) -> None:
        """Record one cross-replica message of ``tensor`` (hooks that call the manager directly)."""
        self.bytes_sent += tensor.numel() * tensor.element_size()
        self.allreduces += 1

    # -- step outcome and heal (stateless by default) ------------------------
    def commit(self) -> None:
        """The step was committed on every replica: apply this step's state changes."""

    def discard(self) -> None:
        """The step was discarded: forget this step's state changes."""

    def state_dict(self) -> Optional[Dict[str, Any]]:
        """State shared by every replica that a joiner must receive, or ``None``."""
        return None

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Load a peer's :meth:`state_dict` (called during a heal)."""

    def describe(self) -> Dict[str, Any]:
        """JSON scalars for the event log's final record (shared state digests)."""
        return {}


class DividedWork:
    """Completes ``work``, the all-reduce (sum) of ``tensor``, by ``tensor /= divisor`` once after a successful wait."""

    def __init__(self, work: Any, tensor: torch.Tensor, divisor: float) -> None:
        self.work, self.tensor, self.divisor = work, tensor, divisor
        self._done = False

    def wait(self, timeout: Any = None) -> bool:
        """``False`` (``tensor`` undefined) when the all-reduce failed, else ``True`` once it holds the quotient."""
        if not wait_result(self.work, self.tensor):
            return False
        if not self._done:
            self.tensor /= self.divisor
            self._done = True
        return True


class CastBackWork:
    """Completes ``work``, a hook run in place on ``low`` (a low-precision copy), by copying ``low`` into ``target``."""

    def __init__(self, work: Any, low: torch.Tensor, target: torch.Tensor) -> None:
        self.work, self.low, self.target = work, low, target

    def wait(self, timeout: Any = None) -> bool:
        """``False`` (``target`` untouched) when the hook's work failed, else ``True`` once ``target`` holds it."""
        if not wait_result(self.work, self.low):
            return False
        self.target.copy_(self.low)
        return True


class ChainWork:
    """Runs ``then()`` once ``first`` completed; ``then`` may return more work to wait for."""

    def __init__(self, first: Any, then: Any) -> None:
        self.first, self.then = first, then

    def wait(self, timeout: Any = None) -> bool:
        self.first.wait()
        more = self.then()
        if more is not None:
            more.wait()
        return True


def wait_result(work: Any, tensor: torch.Tensor) -> bool:
    """Wait for ``work`` (``Work``, or ``Future`` whose tensor is copied in) into ``tensor``; ``False``: it failed."""
    value = work.wait()
    if value is False:
        return False
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    if isinstance(value, torch.Tensor) and value is not tensor:
        same = value.numel() == tensor.numel() and value.data_ptr() == tensor.data_ptr()
        if not same:
            tensor.copy_(value.reshape(tensor.shape))
    return True
