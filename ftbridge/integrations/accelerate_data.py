"""A training loader prepared by Accelerate, re-sharded across replica groups as plain data parallelism would.

:func:`shard_across_replica_groups` gives group G's rank R the batches of plain data parallelism's rank
``G * group_size + R`` of ``N * group_size``; :func:`sharding_refusal` says why a loader cannot be re-sharded
exactly. Why: docs/huggingface.md, "Re-sharding the training loader" and "Refused".
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
                                group_rank: int, movable: bool = False) -> Any:
    """The loader of data-parallel rank ``replica_group_id * group_size + group_rank`` of ``N * group_size``.

    Args:
        loader: a training ``DataLoaderShard`` from ``accelerator.prepare`` in this group, not iterated yet.
        num_replica_groups, replica_group_id, group_size, group_rank: ``N``, ``G``, ranks per group, ``R``.
        movable: return a :class:`MovableLoader`.

    Returns:
        A new ``DataLoaderShard`` (or :class:`MovableLoader`) like ``loader``; its ``iteration`` continues ``loader``'s.

    Raises:
        ValueError: a loader that cannot be re-sharded exactly (:func:`sharding_refusal`), or a topology out of range.
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
    out = _loader_like(loader, shard, loader.iteration, MovableLoader if movable else DataLoaderShard)
    out._is_accelerate_prepared = True  # accelerator.prepare(out) returns it as is
    setattr(out, SHARDED_MARK, True)
    return out


def _loader_like(loader: Any, batch_sampler: Any, iteration: int, cls: Any = DataLoaderShard) -> Any:
    """A ``cls`` (a ``DataLoaderShard``) reading ``batch_sampler``, everything else as ``loader``."""
    kwargs = {k: getattr(loader, k, default) for k, default in _PYTORCH_DATALOADER_KWARGS.items()
              if k not in _REPLACED}
    return cls(loader.dataset, device=loader.device, rng_types=loader.rng_types,
               synchronized_generator=loader.synchronized_generator, _drop_last=loader._drop_last,
               _non_blocking=loader._non_blocking, iteration=iteration, batch_sampler=batch_sampler, **kwargs)


class MovableLoader(DataLoaderShard):
    """A re-sharded training loader whose reads a heal can move to another place in the training stream.

    Each ``iter()`` yields ``len(self)`` batches less a :meth:`skip_first` skip. Positions count micro-batches
    from epoch 0 (epoch ``e``'s batch ``k`` is ``e * len + k``). Unmoved, it reads as a ``DataLoaderShard``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._skip_next = 0
        self._ahead = 0
        self._pending: Optional[int] = None
        self.position = 0
        """The position in the training stream of the next batch this loader reads."""

    def skip_first(self, num_batches: int) -> "MovableLoader":
        """Start the next iteration at batch ``num_batches`` of its epoch (the loop's resume); returns self."""
        self._skip_next = int(num_batches)
        return self

    def reassign(self, *, replica_group_id: int, group_size: int, group_rank: int) -> None:
        """Read as rank ``group_rank`` of group ``replica_group_id`` from the next iteration on (same length);
        ``ValueError`` for a rank outside the group or the loader's data-parallel ranks."""
        shard = self.batch_sampler
        index = replica_group_id * group_size + group_rank
        if not 0 <= group_rank < group_size or not 0 <= index < shard.num_processes:
            raise ValueError(f"replica group {replica_group_id} rank {group_rank} of {group_size}: outside this "
                             f"loader's {shard.num_processes} data-parallel ranks")
        shard.process_index = index

    def move_to(self, position: int) -> None:
        """From the next batch on, read the training stream from ``position`` (>= 0, else ``ValueError``); all ranks
        of a group move together."""
        if position < 0:
            raise ValueError(f"position {position}: a training stream position counts from 0")
        self._pending = int(position)

    def __iter__(self) -> Any:
        n = len(self)
        epoch: int = self.iteration  # type: ignore[has-type]
        done, self._skip_next = epoch * n + self._skip_next, 0
        source: Optional[_Reading] = None
        while done < (epoch + 1) * n:
            if self._pending is not None:
                self._ahead, self._pending = self._pending - done, None
                _close(source)
                source = None
            if source is None:
                source = self._read(*divmod(done + self._ahead, n))
            batch = next(source, _END)
            if batch is _END:
                source = None
                continue
            done += 1
            self.position = done + self._ahead
            yield batch
        _close(source)
        self.iteration = epoch + 1

    def _read(self, epoch: int, skip: int) -> Any:
        """Epoch ``epoch``'s batches from batch ``skip`` on (``SkipBatchSampler``: skipped rows are not loaded)."""
        loop_epoch = self.iteration
        DataLoaderShard.set_epoch(self, epoch)  # the sampler chain this loader shares with the one below
        self.iteration = loop_epoch
        reader = _loader_like(self, SkipBatchSampler(self.batch_sampler, skip_batches=skip), epoch)
        return _Reading(reader)


_END = object()


class _Reading:
    """An iteration of a ``DataLoaderShard`` that can be abandoned cleanly (:func:`_close`)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.it = iter(loader)

    def __next__(self) -> Any:
        return next(self.it)

    def close(self) -> None:
        self.it.close()
        self.loader.end()  # what the loader's own iteration does at its end: leave Accelerate's GradientState


def _close(reading: Optional[_Reading]) -> None:
    if reading is not None:
        reading.close()


def sharding_refusal(loader: Any, group_size: int) -> Optional[str]:
    """Why ``loader`` (prepared over ``group_size`` processes) cannot be re-sharded exactly, or ``None``."""
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

