"""Failure schedules for chaos runs: which failure, when, seeded and reproducible.

A schedule is a pure function of its arguments (no clock, no processes), so
the same seed always gives the same failures in the same order at the same
offsets. Which replica group or rank a failure hits is decided when it is
injected (:mod:`ftbridge.harness.chaos.inject`), from the groups alive then, with a
random generator derived from the same seed.
"""

from __future__ import annotations

import enum
import random
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence


class FailureKind(str, enum.Enum):
    """The failures a chaos run can inject."""

    KILL_RANK = "kill_rank"
    """SIGKILL one rank of a replica group (torchrun restarts the group, which heals)."""
    KILL_GROUP = "kill_group"
    """SIGKILL every rank of a replica group at once (a node lost)."""
    HANG = "hang"
    """SIGSTOP one rank for longer than the cross-replica timeout, then SIGCONT (a straggler)."""
    KILL_JOINER_IN_HEAL = "kill_joiner_in_heal"
    """Kill a group; when it heals, kill it again half-way through receiving its state."""
    KILL_DONOR_IN_HEAL = "kill_donor_in_heal"
    """Kill a group; when it heals, kill its donor half-way through sending (needs 3 or more groups)."""
    KILL_IN_CHECKPOINT = "kill_in_checkpoint"
    """Kill the checkpoint writer after it staged a checkpoint, before it publishes it."""
    LIGHTHOUSE_OUTAGE = "lighthouse_outage"
    """Stop the lighthouse for a set time, then start it again at the same address."""
    SCALE_DOWN = "scale_down"
    """A replica group leaves for good (its launcher is stopped; no restart)."""
    SCALE_UP = "scale_up"
    """A replica group that was not running joins mid-run."""
    LIGHTHOUSE_HANG = "lighthouse_hang"
    """SIGSTOP the lighthouse's process for a set time, then SIGCONT (hung, not dead: connects still succeed)."""
    LIGHTHOUSE_RESTART_EMPTY = "lighthouse_restart_empty"
    """SIGKILL the lighthouse and start a fresh one at once on the same address (no state: quorum ids from 0)."""
    PARTITION_LIGHTHOUSE = "partition_lighthouse"
    """Blackhole one group's link to the lighthouse for a set time (its peers still reach it and the group)."""
    PARTITION_ALL = "partition_all"
    """Blackhole every group's link to a live lighthouse for a set time."""
    LOSSY_LINK = "lossy_link"
    """Cut one group's link to the lighthouse one way for a set time: its requests arrive, no answer returns."""
    SLOW_GROUP = "slow_group"
    """Duty-cycle one group's ranks (stopped half of every 200 ms) for a set time: slow, never dead."""
    PARTITION_PEER = "partition_peer"
    """Cut one group off from the other groups, both ways, silently, for a set time; it still reaches the lighthouse."""


MIN_GROUPS = {FailureKind.KILL_DONOR_IN_HEAL: 3, FailureKind.SCALE_DOWN: 2, FailureKind.PARTITION_LIGHTHOUSE: 2,
              FailureKind.LOSSY_LINK: 2, FailureKind.PARTITION_PEER: 2}
"""Fewest planned replica groups a kind needs: with fewer, no group with state would survive it."""

LIGHTHOUSE_PROCESS = {FailureKind.LIGHTHOUSE_HANG, FailureKind.LIGHTHOUSE_RESTART_EMPTY}
"""Kinds that need the lighthouse in a process of its own (to stop or kill it)."""
PROXIED = {FailureKind.PARTITION_LIGHTHOUSE, FailureKind.PARTITION_ALL, FailureKind.LOSSY_LINK}
"""Kinds that need each group's lighthouse link through a fault proxy (:mod:`ftbridge.harness.netfault`)."""
HOSTED = {FailureKind.PARTITION_PEER}
"""Kinds that need each group on a host of its own (a network namespace: :mod:`ftbridge.harness.netns`)."""
LIGHTHOUSE_FAULTS = {FailureKind.LIGHTHOUSE_OUTAGE, FailureKind.LIGHTHOUSE_HANG, FailureKind.LIGHTHOUSE_RESTART_EMPTY,
                     FailureKind.PARTITION_ALL}
"""Kinds that take the lighthouse from every group at once: the groups ride them out (steps lost are measured)."""


@dataclass(frozen=True)
class Failure:
    """One scheduled failure.

    Attributes:
        index: position in the schedule (0-based); also seeds the choice of target.
        kind: what to inject.
        at_s: earliest injection time, seconds after the run's first commit.
            The runner also waits for the previous failure to be recovered from.
        duration_s: how long a hang, a slowed group, a lighthouse outage or hang, or a link fault
            lasts (seconds); 0 for the other kinds.
    """

    index: int
    kind: FailureKind
    at_s: float
    duration_s: float = 0.0

    def to_json(self) -> Dict[str, object]:
        """A JSON-ready dict."""
        d = asdict(self)
        d["kind"] = self.kind.value
        return d


def parse_kinds(text: str) -> List[FailureKind]:
    """``"kill_rank,hang"`` -> kinds; ``"all"`` -> every kind.

    Raises:
        ValueError: an unknown kind, naming it and the valid ones.
    """
    if text.strip() == "all":
        return list(FailureKind)
    kinds = []
    for name in (t.strip() for t in text.split(",") if t.strip()):
        try:
            kinds.append(FailureKind(name))
        except ValueError:
            raise ValueError(f"failure kind {name!r}: choose from {', '.join(k.value for k in FailureKind)} "
                             "or 'all'") from None
    if not kinds:
        raise ValueError("no failure kinds given: pass e.g. --kinds kill_rank,hang or --kinds all")
    return kinds


def make_schedule(*, seed: int, kinds: Sequence[FailureKind], num_groups: int, count: Optional[int] = None,
                  duration_s: Optional[float] = None, mtbf_s: float = 20.0, hang_s: float = 15.0,
                  outage_s: float = 10.0, first_at_s: float = 5.0) -> List[Failure]:
    """A seeded failure schedule.

    Every kind in ``kinds`` appears at least once (in a seeded order, with a
    scale-up right after the scale-down); the rest are drawn uniformly from
    ``kinds``. Gaps between failures are
    exponential with mean ``mtbf_s`` (a Poisson failure process, the usual
    model of independent node failures), at least 1 s.

    Args:
        seed: random seed; the same arguments give the same schedule.
        kinds: failure kinds to draw from.
        num_groups: planned replica groups of the job (some kinds need more).
        count: number of failures; default ``len(kinds)``.
        duration_s: if given, failures are drawn until ``at_s`` would pass it
            (soak runs), at least ``len(kinds)`` of them.
        mtbf_s: mean time between failures, seconds.
        hang_s: how long a :attr:`FailureKind.HANG` or a :attr:`FailureKind.SLOW_GROUP`
            lasts, seconds (make it longer than the cross-replica timeout).
        outage_s: how long a lighthouse outage or hang, or a link fault (partition, lossy link, a group
            cut off from its peers) lasts, seconds.
        first_at_s: offset of the first failure, seconds.

    Returns:
        Failures ordered by ``at_s``.

    Raises:
        ValueError: no kinds, a non-positive count/mtbf, or a kind that needs
            more replica groups than ``num_groups`` (naming both).
    """
    if not kinds:
        raise ValueError("no failure kinds: give at least one")
    if mtbf_s <= 0 or (count is not None and count < 1):
        raise ValueError(f"mtbf_s={mtbf_s}, count={count}: both must be positive")
    for k in kinds:
        need = MIN_GROUPS.get(FailureKind(k), 1)
        if num_groups < need:
            raise ValueError(f"failure kind {FailureKind(k).value} needs at least {need} replica groups, the job "
                             f"has {num_groups}: add groups (--groups {need}) or drop the kind")
    rng = random.Random(seed)
    order = [FailureKind(k) for k in kinds]
    rng.shuffle(order)
    if FailureKind.SCALE_DOWN in order and FailureKind.SCALE_UP in order:
        # The group that leaves comes back right after: the kinds that need every group alive
        # (a donor killed while a third group heals) then never fall in between.
        order.remove(FailureKind.SCALE_UP)
        order.insert(order.index(FailureKind.SCALE_DOWN) + 1, FailureKind.SCALE_UP)
    out: List[Failure] = []
    t = first_at_s
    while True:
        i = len(out)
        if count is not None and i >= count:
            break
        if count is None and duration_s is None and i >= len(order):
            break
        if duration_s is not None and count is None and i >= len(order) and t > duration_s:
            break
        kind = FailureKind(order[i] if i < len(order) else rng.choice(list(kinds)))
        lasts = hang_s if kind in (FailureKind.HANG, FailureKind.SLOW_GROUP) else (
            outage_s if kind in (LIGHTHOUSE_FAULTS | PROXIED | HOSTED) - {FailureKind.LIGHTHOUSE_RESTART_EMPTY}
            else 0.0)
        out.append(Failure(i, kind, round(t, 3), lasts))
        t += max(1.0, rng.expovariate(1.0 / mtbf_s))
    return out
