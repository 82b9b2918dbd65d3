"""What a unit of work reads and draws: rows of a map-style dataset, and its random numbers.

A unit (:class:`ftbridge.slots.Unit`) may be computed by another replica group than usual, after a
failure or while a warm spare stands in. For the step to train what the failure-free run trains, the
unit's rows and its randomness must be functions of the unit alone, never of the group that computes
it. Both helpers here make them so:

* :class:`UnitSampler`: the indices of a unit's micro-batch in a map-style dataset, exactly those that
  :class:`torch.utils.data.DistributedSampler` (``drop_last=True``) and a ``DataLoader`` of
  ``micro_batch`` rows give data-parallel rank ``unit.dp_rank`` of ``unit.dp_world_size`` in plain
  data parallelism, window by window::

      sampler = UnitSampler.for_engine(engine, len(dataset), seed=1234)
      while engine.global_steps < steps:
          for unit in engine.units():
              with unit_rng(unit, seed=1234):       # dropout as the failure-free run draws it
                  batch = collate([dataset[i] for i in sampler.indices(unit)])
                  engine.backward(loss_fn(engine(batch)))
              engine.step()

* :func:`unit_rng`: a context in which torch's generators (CPU, and the current CUDA device's) are
  seeded from the unit's rows (:func:`ftbridge.slots.unit_seed`); the caller's state is restored on exit.

Python's ``random`` and NumPy's generators are not touched: seed them from :meth:`Unit.seed
<ftbridge.slots.Unit.seed>` inside the context if the forward draws from them.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Tuple

import torch
from torch.utils.data import Dataset, DistributedSampler

from ftbridge.slots import Unit


class _Length(Dataset[int]):
    """A stand-in dataset of ``n`` rows: :class:`DistributedSampler` reads only its length."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


class UnitSampler:
    """Indices of each unit's micro-batch in a map-style dataset, as plain data parallelism reads them.

    Plain data parallelism on ``dp_world_size`` ranks with ``DistributedSampler(dataset,
    num_replicas=dp_world_size, rank=r, shuffle=shuffle, seed=seed, drop_last=True)``, ``set_epoch(e)``
    at each epoch and batches of ``micro_batch`` rows gives rank ``r`` its shard of epoch ``e`` in
    order; every ``micro_steps`` batches make one optimizer step. Here step ``s`` is the
    ``s % steps_per_epoch``-th full window of epoch ``s // steps_per_epoch``; the rows of a shard that
    do not fill a whole window at the end of an epoch are not trained on (so no step straddles two
    epochs, whoever computes it).

    Args:
        num_samples: rows in the dataset (``len(dataset)``), ``>= dp_world_size * micro_batch *
            micro_steps``.
        micro_batch: rows per micro-batch and rank (DeepSpeed's ``train_micro_batch_size_per_gpu``).
        micro_steps: micro-batches per optimizer step (DeepSpeed's ``gradient_accumulation_steps``).
        dp_world_size: data-parallel ranks of the failure-free job (``unit.dp_world_size``).
        shuffle: permute the rows every epoch (``torch.randperm`` seeded with ``seed + epoch``).
        seed: the permutation's seed; the same on every replica group.

    Raises:
        ValueError: a count below 1, or a dataset too small for one step.
    """

    def __init__(self, num_samples: int, micro_batch: int, micro_steps: int, dp_world_size: int, *,
                 shuffle: bool = True, seed: int = 0) -> None:
        for name, value in (("num_samples", num_samples), ("micro_batch", micro_batch),
                            ("micro_steps", micro_steps), ("dp_world_size", dp_world_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"UnitSampler: {name}={value!r} must be an integer >= 1")
        per_step = dp_world_size * micro_batch * micro_steps
        if num_samples < per_step:
            raise ValueError(
                f"UnitSampler: num_samples={num_samples} is fewer than one step's rows ({dp_world_size} "
                f"data-parallel ranks x micro_batch {micro_batch} x {micro_steps} micro-steps = {per_step}); "
                "use a larger dataset or a smaller micro-batch")
        self.num_samples, self.micro_batch, self.micro_steps = num_samples, micro_batch, micro_steps
        self.dp_world_size, self.shuffle, self.seed = dp_world_size, shuffle, seed
        self.steps_per_epoch = (num_samples // dp_world_size) // (micro_batch * micro_steps)
        self._shards: Dict[Tuple[int, int], List[int]] = {}

    @classmethod
    def for_engine(cls, engine: Any, num_samples: int, *, shuffle: bool = True, seed: int = 0) -> "UnitSampler":
        """A sampler with the micro-batch, accumulation steps and data-parallel size of ``engine``.

        Args:
            engine: a :class:`ftbridge.engine.FaultTolerantEngine`; the data-parallel size is ``slots``
                (or the replica groups when slots are off) times the group size.
            num_samples, shuffle, seed: as for the constructor.
        """
        cfg, ds = engine.cfg, engine.engine
        width = (cfg.slots or cfg.num_replica_groups) * cfg.group_size
        return cls(num_samples, int(ds.train_micro_batch_size_per_gpu()), int(ds.gradient_accumulation_steps()),
                   width, shuffle=shuffle, seed=seed)

    def epoch_of(self, step: int) -> int:
        """The epoch whose rows optimizer step ``step`` trains on."""
        return step // self.steps_per_epoch

    def indices(self, unit: Unit) -> List[int]:
        """The ``micro_batch`` dataset indices of ``unit`` (a list of ints, in the data loader's order).

        Raises:
            ValueError: the unit's data-parallel size is not this sampler's, or its micro-batch index
                is not below ``micro_steps``.
        """
        if unit.dp_world_size != self.dp_world_size or not 0 <= unit.micro < self.micro_steps:
            raise ValueError(
                f"UnitSampler: unit (dp_world_size {unit.dp_world_size}, micro {unit.micro}) does not fit this "
                f"sampler (dp_world_size {self.dp_world_size}, micro_steps {self.micro_steps}); build it with "
                "UnitSampler.for_engine(engine, ...)")
        epoch, window = divmod(unit.step, self.steps_per_epoch)
        start = (window * self.micro_steps + unit.micro) * self.micro_batch
        return self._shard(epoch, unit.dp_rank)[start:start + self.micro_batch]

    def _shard(self, epoch: int, dp_rank: int) -> List[int]:
        """``DistributedSampler``'s shard of rank ``dp_rank`` in ``epoch``; the latest epoch's are kept."""
        key = (epoch, dp_rank)
        if key not in self._shards:
            if any(e != epoch for e, _ in self._shards):
                self._shards.clear()
            sampler: DistributedSampler[int] = DistributedSampler(
                _Length(self.num_samples), num_replicas=self.dp_world_size, rank=dp_rank, shuffle=self.shuffle,
                seed=self.seed, drop_last=True)
            sampler.set_epoch(epoch)
            self._shards[key] = list(sampler)
        return self._shards[key]


@contextlib.contextmanager
def unit_rng(unit: Unit, seed: int = 0) -> Iterator[int]:
    """Run the block with torch's generators seeded by ``unit.seed(seed)`` (:func:`seeded_rng`).

    Dropout in the block then draws the same numbers on whichever replica group computes the unit,
    and as plain data parallelism's rank ``unit.dp_rank`` does under
    ``seeded_rng(unit_seed(seed, step, dp_rank, micro))``. Run the forward inside the block; autograd
    replays saved dropout masks in ``backward``, so it may run outside. Activation checkpointing that
    re-runs the forward in ``backward`` must restore the RNG itself (DeepSpeed's and torch's do).

    Yields:
        The 63-bit seed used.
    """
    with seeded_rng(unit.seed(seed)) as value:
        yield value


@contextlib.contextmanager
def seeded_rng(value: int) -> Iterator[int]:
    """Run the block with torch's CPU generator, and the current CUDA device's when CUDA is available,
    forked (:func:`torch.random.fork_rng`) and seeded with ``value``; the caller's state is restored on
    exit, so its own stream is not disturbed.

    Yields:
        ``value``.
    """
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.default_generator.manual_seed(value)
        if devices:
            torch.cuda.manual_seed(value)  # the current device only: the others are not forked
        yield value
