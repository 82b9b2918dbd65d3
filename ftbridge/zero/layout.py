"""Which parameter each element of a rank's ZeRO gradient partition belongs to, read from DeepSpeed.

Cuts the partition as ``optimizer.step()`` reads it (:meth:`ftbridge.zero.adapter.ZeroAdapter.partition_grads`
concatenated) into :class:`Fragment` s from DeepSpeed 0.19's bookkeeping: :func:`stage12_layout`
(``params_in_partition``, ``grad_start_offset``, ``grad_partition_insertion_offset``, ``partition_size``;
also the CPU partition under offload) and :func:`stage3_layout` (``fp16_groups``, ``partition_numel()``,
``ds_shape``). The readers raise unless the fragments are disjoint and fill the partition. Used by
:mod:`ftbridge.zero.messages` and :mod:`ftbridge.comm_hooks.powersgd`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, List, Sequence, Tuple

import torch.distributed as dist


@dataclass(frozen=True)
class Fragment:
    """Elements ``[param_start, param_start + numel)`` of a parameter, at ``offset`` in the partition."""

    offset: int
    numel: int
    shape: Tuple[int, ...]
    param_start: int = 0
    key: int = -1
    """DeepSpeed's id of the parameter (ZeRO-1/2 ``get_param_id``, ZeRO-3 ``ds_id``); -1 when unknown."""


@dataclass
class PartitionLayout:
    """The fragments of one rank's flat partition; pads are the gaps between them."""

    numel: int
    fragments: List[Fragment] = field(default_factory=list)


def layout_from_shapes(shapes: Sequence[Sequence[int]]) -> PartitionLayout:
    """Layout of whole parameters concatenated in order (no ZeRO; tests and DDP-like use)."""
    frags, offset = [], 0
    for s in shapes:
        n = math.prod(s)
        frags.append(Fragment(offset, n, tuple(s)))
        offset += n
    return PartitionLayout(offset, frags)


def stage12_layout(opt: Any) -> PartitionLayout:
    """The layout of a ZeRO-1/2 optimizer's partition.

    Raises:
        ValueError: DeepSpeed's bookkeeping is missing or inconsistent.
    """
    try:
        frags: List[Fragment] = []
        base = 0
        for i in range(len(opt.bit16_groups)):
            pid = dist.get_rank(group=opt.real_dp_process_group[i])
            size = int(opt.partition_size[i])
            for p in opt.params_in_partition[i]:
                pid_ = opt.get_param_id(p)
                src = int(opt.grad_start_offset[i][pid][pid_])
                dst = int(opt.grad_partition_insertion_offset[i][pid][pid_])
                n = int(min(p.numel() - src, size - dst))
                frags.append(Fragment(base + dst, n, tuple(p.shape), src, pid_))
            base += size
    except (AttributeError, KeyError, IndexError) as e:
        raise ValueError(f"cannot read the ZeRO-1/2 partition layout from {type(opt).__name__} ({e!r}); "
                         "use comm_hook='batched_power_sgd', which needs no layout") from e
    return _checked(PartitionLayout(base, frags))


def stage3_layout(opt: Any) -> PartitionLayout:
    """The layout of a ZeRO-3 optimizer's partition (``grad_partitions_flat_buffer``).

    Raises:
        ValueError: DeepSpeed's bookkeeping is missing or inconsistent.
    """
    try:
        rank = dist.get_rank(group=opt.dp_process_group)
        frags, offset = [], 0
        for group in opt.fp16_groups:
            for p in group:
                n = int(p.partition_numel())
                start = rank * n
                valid = max(0, min(n, int(p.ds_numel) - start))
                frags.append(Fragment(offset, valid, tuple(p.ds_shape), start, int(p.ds_id)))
                offset += n
    except AttributeError as e:
        raise ValueError(f"cannot read the ZeRO-3 partition layout from {type(opt).__name__} ({e!r}); "
                         "use comm_hook='batched_power_sgd', which needs no layout") from e
    return _checked(PartitionLayout(offset, frags))


def _checked(layout: PartitionLayout) -> PartitionLayout:
    end = 0
    for f in sorted(layout.fragments, key=lambda f: f.offset):
        if f.offset < end or f.offset + f.numel > layout.numel:
            raise ValueError(f"inconsistent partition layout at offset {f.offset} (fragment {f}); "
                             "use comm_hook='batched_power_sgd', which needs no layout")
        end = f.offset + f.numel
    return layout
