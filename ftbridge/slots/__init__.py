"""Slots: the job's fixed data-parallel grid, and which live replica group computes each unit of it (pure).

A step is N slots x G micro-batches; :func:`home_units` gives a group's units, :func:`assign` the step's
plan (every unit once, at most :func:`max_load` each), :func:`config_digest` what the agreement compares.
Every rank computes the same plan alone. I/O: :mod:`.steps`, :mod:`.data`.
Why: docs/design.md, "Failure-transparent training: the slot plan".
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Dict, Iterable, List, Tuple

UnitKey = Tuple[int, int]
"""``(slot, micro)``: one micro-batch of one slot in a step."""

DIGEST_BITS = 20
"""Width of :func:`config_digest`: exact in a float64 agreement row."""


@dataclasses.dataclass(frozen=True)
class Unit:
    """One unit of work as a rank computes it: optimizer ``step``, ``slot`` (< ``slots``), ``micro`` (< G), the
    computing ``group_rank``, ``group_size``, and the job's ``slots`` (N)."""

    step: int
    slot: int
    micro: int
    group_rank: int
    group_size: int
    slots: int

    @property
    def dp_rank(self) -> int:
        """Data-parallel rank whose rows this is: ``slot * group_size + group_rank``."""
        return self.slot * self.group_size + self.group_rank

    @property
    def dp_world_size(self) -> int:
        """Data-parallel ranks of the failure-free job: ``slots * group_size``."""
        return self.slots * self.group_size

    def seed(self, seed: int) -> int:
        """:func:`unit_seed` of this unit: the same on whichever group computes it."""
        return unit_seed(seed, self.step, self.dp_rank, self.micro)


def unit_seed(seed: int, step: int, dp_rank: int, micro: int) -> int:
    """A 63-bit RNG seed of ``seed`` and a unit's rows (step, data-parallel rank, micro-batch), whichever group computes
    it: blake2b (RFC 7693), 8 bytes, little-endian, halved."""
    key = f"{seed}/{step}/{dp_rank}/{micro}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def check_grid(slots: int, micro: int, groups: int) -> None:
    """Raise ``ValueError`` (naming the value and the fix) for a grid no plan can cover: ``slots`` (N), ``micro`` (G) or
    ``groups`` (M) below 1, or M > N."""
    if slots < 1:
        raise ValueError(f"slots={slots}: use at least 1 (the default is the number of replica groups)")
    if micro < 1:
        raise ValueError(f"gradient_accumulation_steps={micro}: must be at least 1")
    if groups < 1:
        raise ValueError(f"num_replica_groups={groups}: must be at least 1")
    if groups > slots:
        raise ValueError(f"num_replica_groups={groups} is more than slots={slots}: a group would hold no slot; "
                         f"use slots >= {groups}, or fewer replica groups")


def home_units(slots: int, micro: int, groups: int, group: int) -> List[UnitKey]:
    """The units replica group ``group`` computes first, in grid order: block ``group`` of ``groups`` contiguous blocks
    of ``k = slot * micro + m``, ``[g * T // groups, (g + 1) * T // groups)`` with ``T = slots * micro``.

    Raises:
        ValueError: see :func:`check_grid`, or ``group`` outside ``[0, groups)``.
    """
    check_grid(slots, micro, groups)
    if not 0 <= group < groups:
        raise ValueError(f"replica group {group} outside [0, {groups})")
    total = slots * micro
    return [divmod(k, micro) for k in range(group * total // groups, (group + 1) * total // groups)]


def max_load(slots: int, micro: int, participants: int) -> int:
    """The most units :func:`assign` gives one participant: ``ceil(slots * micro / participants)``."""
    return -(-slots * micro // participants)


def assign(slots: int, micro: int, groups: int, participants: Iterable[int]) -> Dict[int, Tuple[UnitKey, ...]]:
    """This step's plan ``{group: units}`` for the participating replica group ids (any order, no repeats).

    Each participant keeps its :func:`home_units` first; the absent groups' units, in grid order, go one at a
    time to the participant with the fewest so far (ties: the lowest id). Every unit appears exactly once, at
    most :func:`max_load` per participant (docs/design.md, "Orphans"). ``groups`` is M (<= ``slots``).

    Raises:
        ValueError: see :func:`check_grid`; no participant, a repeated one, or one outside ``[0, groups)``.
    """
    check_grid(slots, micro, groups)
    present = sorted(participants)
    if not present:
        raise ValueError("no participating replica group: nobody can compute the step")
    if len(set(present)) != len(present):
        raise ValueError(f"participants {present} repeat a replica group")
    if present[0] < 0 or present[-1] >= groups:
        raise ValueError(f"participants {present} outside replica groups [0, {groups})")
    plan = {g: home_units(slots, micro, groups, g) for g in present}
    for absent in sorted(set(range(groups)) - set(present)):
        for unit in home_units(slots, micro, groups, absent):
            taker = min(present, key=lambda g: (len(plan[g]), g))
            plan[taker].append(unit)
    return {g: tuple(units) for g, units in plan.items()}


def config_digest(slots: int, micro: int, micro_batch: int, group_size: int, seed: int) -> int:
    """A :data:`DIGEST_BITS`-bit digest of the settings every participant must share (blake2b)."""
    key = f"{slots}/{micro}/{micro_batch}/{group_size}/{seed}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") % (1 << DIGEST_BITS)
