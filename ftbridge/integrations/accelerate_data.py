"""A training loader prepared by Accelerate, re-sharded across replica groups as plain data parallelism would.

Each replica group is its own torch.distributed world, so ``accelerator.prepare`` shards a loader by the
group's ``num_processes`` and ``process_index``: without more, rank R of every group reads what rank R of
group 0 reads, and the groups average identical gradients. :func:`shard_across_replica_groups` gives group
G's rank R the rows that plain data parallelism on ``N * group_size`` ranks gives rank ``G * group_size + R``
(``N`` replica groups), in the same batches and the same order, every epoch: the loader Accelerate
prepared is rebuilt around its own batch sampler with Accelerate's own ``BatchSamplerShard`` over
``N * group_size`` processes, with ``even_batches`` on. Its length is then the same on every rank of every
group, so every group ends an epoch (and Accelerate's accumulation window at the end of the loader) at
the same step.

Exact, and so accepted, for a map-style dataset with a sampler whose order is the same in every group:
a ``SequentialSampler``, Accelerate's ``SeedableRandomSampler`` (``use_seedable_sampler=True``: the order
is a function of the seed and the epoch), or a custom sampler with that property. Refused, each with a
``ValueError`` that names the setting and the fix: ``split_batches``, ``even_batches=False``,
``dispatch_batches``, an ``IterableDataset``, a ``StatefulDataLoader``, a plain ``RandomSampler`` (its
order comes from each group's own random state), a ``DistributedSampler`` (it would shard twice), a
loader already cut by ``skip_first_batches``, or one re-sharded already.
"""

from __future__ import annotations

from typing import Any, Optional

from accelerate.data_loader import (
    _PYTORCH_DATALOADER_KWARGS,
    BatchSamplerShard,
    DataLoaderDispatcher,
    DataLoaderShard,
    SeedableRandomSampler,
    SkipBatchSampler,
)
from torch.utils.data import BatchSampler, DistributedSampler, IterableDataset, RandomSampler

_REPLACED = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last")
"""DataLoader arguments the new batch sampler stands for."""

SHARDED_MARK = "_ftbridge_replica_sharded"
"""Attribute set on a loader :func:`shard_across_replica_groups` returned."""


def shard_across_replica_groups(loader: Any, *, num_replica_groups: int, replica_group_id: int, group_size: int,
                                group_rank: int) -> Any:
    """The loader of data-parallel rank ``replica_group_id * group_size + group_rank`` of ``N * group_size``.

    Args:
        loader: a training ``DataLoader`` returned by ``accelerator.prepare`` in this replica group
            (an Accelerate ``DataLoaderShard``), not iterated into yet by a loop that must stay exact.
        num_replica_groups: ``N``, the job's replica groups (``cfg.num_replica_groups``).
        replica_group_id: this group's id ``G`` (after a warm spare took one over).
        group_size: ranks per replica group.
        group_rank: this rank in its group ``R``.

    Returns:
        A new ``DataLoaderShard`` on the same dataset, device, collate function, workers and random
        state synchronisation; its ``len()``, batches and per-epoch order are those of plain data
        parallelism's rank ``G * group_size + R`` (Accelerate's ``prepare_data_loader`` with
        ``num_processes=N * group_size``), and its ``iteration`` (epoch) continues the given loader's.

    Raises:
        ValueError: a loader or setting that cannot be re-sharded exactly (see the module docstring),
            or a topology out of range.
    """
    if not (num_replica_groups >= 1 and 0 <= replica_group_id < num_replica_groups and group_size >= 1
            and 0 <= group_rank < group_size):
        raise ValueError(f"replica group {replica_group_id} of {num_replica_groups}, rank {group_rank} of "
                         f"{group_size}: need 0 <= group < groups and 0 <= rank < group size")
    refused = sharding_refusal(loader, group_size)
    if refused:
        raise ValueError(refused)
    shard = BatchSamplerShard(_inner_batch_sampler(loader), num_processes=num_replica_groups * group_size,
                              process_index=replica_group_id * group_size + group_rank, split_batches=False,
                              even_batches=True)
    kwargs = {k: getattr(loader, k, default) for k, default in _PYTORCH_DATALOADER_KWARGS.items()
              if k not in _REPLACED}
    out = DataLoaderShard(loader.dataset, device=loader.device, rng_types=loader.rng_types,
                          synchronized_generator=loader.synchronized_generator, _drop_last=loader._drop_last,
                          _non_blocking=loader._non_blocking, iteration=loader.iteration, batch_sampler=shard,
                          **kwargs)
    out._is_accelerate_prepared = True  # accelerator.prepare(out) returns it as is
    setattr(out, SHARDED_MARK, True)
    return out


def sharding_refusal(loader: Any, group_size: int) -> Optional[str]:
    """Why :func:`shard_across_replica_groups` cannot re-shard ``loader`` exactly, or ``None``.

    Args:
        loader: what ``accelerator.prepare`` returned for a ``DataLoader``.
        group_size: ranks per replica group (the ``num_processes`` Accelerate sharded by).
    """
    if getattr(loader, SHARDED_MARK, False):
        return "this loader is re-sharded across replica groups already: call shard_across_replica_groups once"
    if isinstance(loader, DataLoaderDispatcher):
        return ("dispatch_batches=True (Accelerate's default for an IterableDataset) is not supported across "
                "replica groups: use a map-style dataset, or DataLoaderConfiguration(dispatch_batches=False)")
    if not isinstance(loader, DataLoaderShard):
        return (f"expected the DataLoader accelerator.prepare returned, got {type(loader).__name__}: call "
                "shard_across_replica_groups(accelerator.prepare(loader))")
    if isinstance(loader.dataset, IterableDataset):
        return ("an IterableDataset cannot be re-sharded across replica groups exactly yet: use a map-style "
                "dataset (with __getitem__ and __len__)")
    if getattr(loader, "use_stateful_dataloader", False):
        return ("use_stateful_dataloader=True is not supported across replica groups yet: set "
                "DataLoaderConfiguration(use_stateful_dataloader=False)")
    if isinstance(loader.sampler, BatchSampler):
        return ("a BatchSampler passed as sampler= is not supported across replica groups: pass it as "
                "DataLoader(dataset, batch_sampler=...)")
    batch_sampler = loader.batch_sampler
    if isinstance(batch_sampler, SkipBatchSampler) or loader.skip_batches:
        return ("this loader skips its first batches (skip_first_batches): call shard_across_replica_groups "
                "first, then accelerator.skip_first_batches on what it returns")
    if isinstance(batch_sampler, BatchSamplerShard):
        if batch_sampler.split_batches:
            return ("split_batches=True is not supported across replica groups: set "
                    "DataLoaderConfiguration(split_batches=False) and divide the batch size by the group size")
        if not batch_sampler.even_batches:
            return ("even_batches=False gives replica groups loaders of different lengths, which ends their "
                    "epochs at different steps: set DataLoaderConfiguration(even_batches=True)")
        if batch_sampler.num_processes != group_size:
            return (f"the loader is sharded over {batch_sampler.num_processes} processes, not over the replica "
                    f"group's {group_size}: prepare it with this group's accelerator")
    elif group_size != 1:
        return f"the loader is not sharded over the replica group's {group_size} processes: prepare it first"
    return _sampler_refusal(getattr(_inner_batch_sampler(loader), "sampler", None))


def _sampler_refusal(sampler: Any) -> Optional[str]:
    if isinstance(sampler, DistributedSampler):
        return ("the loader has a DistributedSampler, which shards the data already (twice with this call): "
                "use a plain sampler and let shard_across_replica_groups shard it")
    if isinstance(sampler, RandomSampler) and not isinstance(sampler, SeedableRandomSampler):
        return ("shuffle=True draws each epoch's order from each replica group's own random state, which the "
                "groups do not share: set DataLoaderConfiguration(use_seedable_sampler=True) (and the same "
                "accelerate.utils.set_seed in every group, or data_seed)")
    return None


def _inner_batch_sampler(loader: Any) -> Any:
    """The batch sampler the user's loader had, under Accelerate's per-group ``BatchSamplerShard``."""
    batch_sampler = loader.batch_sampler
    return batch_sampler.batch_sampler if isinstance(batch_sampler, BatchSamplerShard) else batch_sampler

