"""Cross-replica averaging of ZeRO gradient partitions.

After DeepSpeed has reduced the gradients inside the replica group, each rank
holds the reduced gradient of its own partition. ftbridge averages that
partition across the replica groups (ranks with the same group rank) through
the torchft manager, so every replica steps on the same gradient. All work
completes before DeepSpeed's overflow check, gradient norm and clipping in
``optimizer.step()``, so every replica clips the same way.

:class:`PostBackwardSync` issues one all-reduce of the whole flat partition
when the backward pass of the accumulation boundary has finished: simple,
no overlap with backward, and the baseline the per-bucket hook
(:mod:`ftbridge.zero.bucket_hook`) is measured against. Under optimizer
offload the partition is consumed during backward, and
:mod:`ftbridge.zero.offload_hook` averages each bucket there instead.

Every cross-replica message goes through a communication hook
(:mod:`ftbridge.comm_hooks`; the default is the plain average): the hook
gets the flat partition and a state whose ``allreduce`` is torchft's managed
one. A hook that raises is reported to the manager, so the step is
discarded on every replica, like a failed all-reduce. Hooks with state
(PowerSGD) are told whether the step committed (:meth:`commit`,
:meth:`reset`), and get the partition's fragment layout once, at install.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, List, Optional, Tuple

import torch

from ftbridge.comm_hooks.base import CommHookState, wait_result
from ftbridge.comm_hooks.default import allreduce_hook
from ftbridge.manager import ReplicaManager
from ftbridge.zero.stages import ZeroAdapter

logger = logging.getLogger(__name__)


class PostBackwardSync:
    """One all-reduce of the rank's whole gradient partition per optimizer step.

    Args:
        manager: the rank's replica manager.
        adapter: where the partition lives for this ZeRO stage.
        hook: communication hook ``hook(state, flat) -> work``; default plain average.
        hook_state: its state; default a :class:`CommHookState` of ``manager``.
    """

    def __init__(self, manager: ReplicaManager, adapter: ZeroAdapter,
                 hook: Optional[Callable[..., Any]] = None, hook_state: Optional[CommHookState] = None) -> None:
        self.manager = manager
        self.adapter = adapter
        self.hook = hook or allreduce_hook
        self.hook_state = hook_state if hook_state is not None else CommHookState(manager)
        self._pending: List[Tuple[Any, torch.Tensor, List[torch.Tensor]]] = []
        self.enabled = True
        """Testing only: ``False`` skips the all-reduce, and the replica groups diverge."""

    @property
    def bytes_sent(self) -> int:
        """Bytes handed to the cross-replica all-reduce so far (payload, not wire bytes)."""
        return self.hook_state.bytes_sent

    @property
    def allreduces(self) -> int:
        """Cross-replica all-reduce calls so far."""
        return self.hook_state.allreduces

    def install(self) -> None:
        """Give a hook that needs it the partition's fragment layout (nothing to patch)."""
        if self.hook_state.needs_partition and self.hook_state.layout is None:
            from ftbridge.comm_hooks.fragments import PartitionLayout, layout_for

            try:
                self.hook_state.layout = layout_for(self.adapter)
            except ValueError:
                if not getattr(self.hook_state, "batched", False):
                    raise
                self.hook_state.layout = PartitionLayout(sum(t.numel() for t in self.adapter.partition_grads()))

    def on_boundary_backward(self) -> None:
        """Start the asynchronous all-reduce of the partition (after the boundary backward)."""
        if self.enabled:
            self._issue(self.adapter.partition_grads())

    def _issue(self, tensors: List[torch.Tensor]) -> None:
        """Start averaging ``tensors`` in place across replica groups (one all-reduce)."""
        tensors = [t for t in tensors if t.numel() > 0]
        if not tensors:
            return
        if len(tensors) == 1 and tensors[0].is_contiguous():
            flat = tensors[0].view(-1)
            targets: List[torch.Tensor] = []
        else:
            flat = torch.cat([t.reshape(-1) for t in tensors])
            targets = tensors
        try:
            work = self.hook(self.hook_state, flat)
        except Exception as e:  # a hook's failure discards the step, like a failed all-reduce
            logger.exception("communication hook %s failed; the step will be discarded",
                             getattr(self.hook, "__name__", self.hook))
            self.manager.report_error(e)
            return
        self._pending.append((work, flat, targets))

    def wait(self) -> None:
        """Block until every pending all-reduce finished and results are in place.

        Failures do not raise: torchft records them and the step is discarded.
        """
        pending, self._pending = self._pending, []
        for work, flat, targets in pending:
            try:
                wait_result(work, flat)
            except Exception as e:
                logger.exception("communication hook work failed; the step will be discarded")
                self.manager.report_error(e)
                continue
            offset = 0
            for t in targets:
                n = t.numel()
                t.copy_(flat[offset:offset + n].view_as(t))
                offset += n

    def commit(self) -> None:
        """The step committed on every replica: the hook applies its state changes."""
        self.hook_state.commit()

    def reset(self) -> None:
        """Forget pending work (after a discarded step); the hook forgets its state changes."""
        self._pending = []
        self.hook_state.discard()
