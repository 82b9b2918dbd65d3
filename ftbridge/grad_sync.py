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
(:mod:`ftbridge.zero.bucket_hook`) is measured against.
"""

from __future__ import annotations

import logging
from typing import Any, List, Tuple

import torch

from ftbridge.manager import ReplicaManager
from ftbridge.zero.stages import ZeroAdapter

logger = logging.getLogger(__name__)


class PostBackwardSync:
    """One all-reduce of the rank's whole gradient partition per optimizer step.

    Args:
        manager: the rank's replica manager.
        adapter: where the partition lives for this ZeRO stage.
    """

    def __init__(self, manager: ReplicaManager, adapter: ZeroAdapter) -> None:
        self.manager = manager
        self.adapter = adapter
        self._pending: List[Tuple[Any, torch.Tensor, List[torch.Tensor]]] = []
        self.bytes_sent = 0
        """Bytes handed to the cross-replica all-reduce so far (payload, not wire bytes)."""
        self.allreduces = 0
        """Cross-replica all-reduce calls so far."""
        self.enabled = True
        """Testing only: ``False`` skips the all-reduce, and the replica groups diverge."""

    def install(self) -> None:
        """Nothing to patch in this mode."""

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
        self.bytes_sent += flat.numel() * flat.element_size()
        self.allreduces += 1
        self._pending.append((self.manager.allreduce(flat), flat, targets))

    def wait(self) -> None:
        """Block until every pending all-reduce finished and results are in place.

        Failures do not raise: torchft records them and the step is discarded.
        """
        pending, self._pending = self._pending, []
        for work, flat, targets in pending:
            work.wait()
            offset = 0
            for t in targets:
                n = t.numel()
                t.copy_(flat[offset:offset + n].view_as(t))
                offset += n

    def reset(self) -> None:
        """Forget pending work (after a discarded step)."""
        self._pending = []
