"""What a unit of work reads and draws, as functions of the unit alone: :class:`UnitSampler` (its dataset
indices) and :func:`unit_rng` (torch's generators seeded from its rows). Python's ``random`` and NumPy are
not touched. Usage: docs/your-script.md, "The same model whatever fails (slots)"; why: docs/design.md,
"Failure-transparent training: the slot plan".
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Tuple

import torch
from torch.utils.data import Dataset, DistributedSampler

from ftbridge.slots import Unit


class _Length(Dataset[int]):
    """A stand-in dataset of ``n`` rows (:class:`DistributedSampler` reads only its length)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


class UnitSampler:
    """Indices of each unit's micro-batch in a map-style dataset, as plain data parallelism reads them.

    The same as ``DistributedSampler(num_replicas=dp_world_size, rank=unit.dp_rank, shuffle, seed,
    drop_last=True)`` with ``set_epoch`` and batches of ``micro_batch``: step ``s`` is window
    ``s % steps_per_epoch`` of epoch ``s // steps_per_epoch``; rows that do not fill a window at an epoch's
    end are skipped.

    Args:
        num_samples: rows in the dataset, ``>= dp_world_size * micro_batch * micro_steps``.
        micro_batch, micro_steps: DeepSpeed's micro-batch per rank and accumulation steps.
        dp_world_size: data-parallel ranks of the failure-free job (``unit.dp_world_size``).
        shuffle, seed: permute every epoch with ``torch.randperm`` seeded ``seed + epoch`` (same on every group).

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
        """A sampler with ``engine``'s micro-batch, accumulation steps and data-parallel size (``slots``, or the replica
        groups, times the group size); ``engine`` is ftbridge's engine or a ``DeepSpeedEngine`` it is attached to."""
        engine = getattr(engine, "ftbridge", engine)
        cfg, ds = engine.cfg, engine.engine
        width = (cfg.slots or cfg.num_replica_groups) * cfg.group_size
        return cls(num_samples, int(ds.train_micro_batch_size_per_gpu()), int(ds.gradient_accumulation_steps()),
                   width, shuffle=shuffle, seed=seed)

    def epoch_of(self, step: int) -> int:
        """The epoch whose rows optimizer step ``step`` trains on."""
        return step // self.steps_per_epoch

    def indices(self, unit: Unit) -> List[int]:
        """The ``micro_batch`` dataset indices of ``unit``, in the data loader's order.

        Raises:
            ValueError: the unit's data-parallel size is not this sampler's, or ``unit.micro >= micro_steps``.
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
        """``DistributedSampler``'s shard of ``dp_rank`` in ``epoch``; only the latest epoch's are cached."""
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
    """Run the block with torch's generators seeded by ``unit.seed(seed)`` (:func:`seeded_rng`); yields the 63-bit seed.

    Run the forward inside the block (autograd replays saved dropout masks, so ``backward`` may run outside).
    Activation checkpointing that re-runs the forward must restore the RNG itself (DeepSpeed's and torch's do).
    """
    with seeded_rng(unit.seed(seed)) as value:
        yield value


@contextlib.contextmanager
def seeded_rng(value: int) -> Iterator[int]:
    """Run the block with torch's CPU generator, and the current CUDA device's if any, forked
    (:func:`torch.random.fork_rng`) and seeded with ``value``; the caller's state is restored on exit. Yields ``value``.
    """
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.default_generator.manual_seed(value)
        if devices:
            torch.cuda.manual_seed(value)  # the current device only: the others are not forked
        yield value
