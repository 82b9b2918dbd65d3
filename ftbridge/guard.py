"""Divergence guard: replica groups compare a fingerprint of their state every N committed steps.

The gradient sync is meant to keep every replica group identical after every
commit (:mod:`ftbridge.zero.grad_sync`); the guard checks that it did, so a
bug of that kind (a sync that pairs the wrong gradients, a hook that skips a
bucket, a kernel that is not deterministic across machines) shows up as an
event and is repaired, instead of training on quietly on different models.

Every ``guard_every`` committed steps (:class:`ftbridge.config.FTBridgeConfig`,
``FTBRIDGE_GUARD_EVERY``; 0 turns it off), inside the next step, after its
gradient messages and before its commit vote (so the check is one more
message of a step every participant runs, and a failure of it discards that
step like any other):

1. each rank takes a SHA-256 fingerprint of what its optimizer steps on: the
   fp32 master partition and the optimizer state of its partition
   (:meth:`ftbridge.zero.adapter.ZeroAdapter.fingerprint_tensors`);
2. one small all-reduce (SUM, float64) over the cross-replica group gathers
   every participant's fingerprint: replica rank ``i`` writes
   ``[replica_group_id + 1, four 16-bit chunks of its 64-bit digest]`` into
   slot ``i`` of a zero tensor (exact in float64); a slot left at zero (a
   replica that was healing) is not compared;
3. each rank compares every slot with the quorum's primary (replica rank 0);
   the ranks of a replica group agree (an in-group MAX) on whether their group
   differs, since all of a group's ranks must heal together.

On a mismatch the guard writes a ``divergence`` event (step, primary group,
the differing groups, every digest), logs a warning naming the groups, and
then, by ``guard_action``:

* ``heal`` (default): the groups that differ from the primary report an error
  for the step under way, so they discard it while the others commit; being
  one step behind, torchft heals them from an up-to-date peer at the next
  quorum. The primary and the groups that agree with it go on;
* ``stop``: every rank raises :class:`ReplicaDivergenceError` (a non-zero exit
  of every replica group, after the event is written).

Cost: one pass over the partition and its optimizer state (SHA-256, about
0.5 GB/s on one core) and one all-reduce of ``5 * participants`` float64 every
``guard_every`` steps; ``ftbridge-bench overhead`` reports it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from ftbridge.device import collective_device, group_backend
from ftbridge.events import tensor_checksum

logger = logging.getLogger(__name__)

SLOT = 5
"""float64 values per participant: replica group id + 1, then four 16-bit digest chunks."""


class ReplicaDivergenceError(RuntimeError):
    """Replica groups hold different state after a commit and ``guard_action`` is ``stop``."""


@dataclass(frozen=True)
class Verdict:
    """What one guard check found.

    Attributes:
        digests: replica group id -> 16 hex digit digest, for every reporting participant.
        primary: replica group id of the quorum's primary (replica rank 0), or ``None`` if it did not report.
        differing: replica group ids whose digest differs from the primary's.
    """

    digests: Dict[int, str]
    primary: Optional[int]
    differing: List[int]

    @property
    def ok(self) -> bool:
        """Every reporting replica holds what the primary holds."""
        return not self.differing


def encode_slot(replica_group_id: int, digest: str) -> List[float]:
    """This replica's slot: ``[group id + 1, four 16-bit chunks of the 64-bit hex digest]`` (exact in float64).

    Raises:
        ValueError: ``digest`` is not 16 hex digits, or the group id is negative.
    """
    if replica_group_id < 0 or len(digest) != 16:
        raise ValueError(f"guard slot needs a replica group id >= 0 and a 16 hex digit digest, got "
                         f"{replica_group_id} and {digest!r}")
    value = int(digest, 16)
    return [float(replica_group_id + 1)] + [float((value >> (16 * i)) & 0xFFFF) for i in range(4)]


def decode_slots(gathered: torch.Tensor) -> List[Optional[tuple]]:
    """``(replica_group_id, digest)`` per slot of a summed guard tensor, ``None`` for empty slots."""
    out: List[Optional[tuple]] = []
    rows = gathered.double().view(-1, SLOT).tolist()
    for row in rows:
        if row[0] == 0:
            out.append(None)
            continue
        value = sum(int(round(c)) << (16 * i) for i, c in enumerate(row[1:]))
        out.append((int(round(row[0])) - 1, f"{value:016x}"))
    return out


def judge(slots: List[Optional[tuple]]) -> Verdict:
    """Compare every reporting slot with slot 0, the quorum's primary (pure: no communication)."""
    digests = {s[0]: s[1] for s in slots if s is not None}
    primary = slots[0][0] if slots and slots[0] is not None else None
    if primary is None:
        return Verdict(digests, None, [])
    want = digests[primary]
    return Verdict(digests, primary, sorted(g for g, d in digests.items() if d != want))


def gather_rows(manager: Any, row: List[float]) -> torch.Tensor:
    """Every participant's ``row``, one SUM all-reduce: ``(participants, len(row))`` float64, zeros where absent.

    Replica rank ``i`` writes its row into row ``i`` of a zero tensor; the sum
    is then an all-gather, exact in float64 for integers below 2**53. A
    replica without a rank (healing), or one torchft zeroes, leaves its row at zero.

    Raises:
        Whatever the manager's ``allreduce`` or its work's ``wait`` raises.
    """
    n, rank = max(int(manager.participants), 1), manager.replica_rank
    where = collective_device(getattr(manager, "backend", "gloo"))  # NCCL takes only GPU tensors
    rows = torch.zeros(n, len(row), dtype=torch.float64, device=where)
    if rank is not None and 0 <= rank < n:
        rows[rank] = torch.tensor(row, dtype=torch.float64)
    manager.allreduce(rows, reduce_op=ReduceOp.SUM).wait()
    return rows.cpu()


class DivergenceGuard:
    """Compares replica groups every ``every`` committed steps and acts on a mismatch.

    Args:
        manager: the rank's replica manager (``allreduce``, ``participants``,
            ``replica_rank``, ``report_error``).
        adapter: the engine's ZeRO adapter (``fingerprint_tensors``).
        replica_group_id: this rank's replica group.
        every: committed steps between checks (0: never).
        action: ``"heal"`` or ``"stop"``.
        events: the engine's event log.
        group: the replica group's process group for the in-group agreement
            (default: the default world, which ftbridge makes the replica group).
    """

    def __init__(self, manager: Any, adapter: Any, *, replica_group_id: int, every: int, action: str,
                 events: Any, group: Any = None) -> None:
        if every < 0 or action not in ("heal", "stop"):
            raise ValueError(f"guard every={every} (>= 0) action={action!r} ('heal' or 'stop')")
        self.manager, self.adapter, self.group_id = manager, adapter, replica_group_id
        self.every, self.action, self.events, self.group = every, action, events, group
        self.checks = 0
        """Guard checks that compared at least two replicas."""
        self.mismatches = 0
        """Checks that found a replica differing from the primary."""
        self.seconds = 0.0
        """Wall time spent in checks, seconds."""

    def due(self, step: int) -> bool:
        """Whether the state after committed step ``step`` is checked."""
        return self.every > 0 and step > 0 and step % self.every == 0

    def check(self, step: int) -> Optional[Verdict]:
        """Compare the state after committed step ``step`` if due; act on a mismatch.

        Every rank of every participating group calls it at the same point
        of the step after ``step`` (after the gradient messages, before the vote).

        Returns:
            The verdict, or ``None`` when not due or when the all-reduce failed
            (then the check is skipped and logged; the step is discarded anyway).

        Raises:
            ReplicaDivergenceError: a mismatch and ``action == "stop"``.
        """
        if not self.due(step):
            return None
        t0 = time.perf_counter()
        verdict = self._gather()
        if verdict is None:
            return None
        group_differs, any_differs = self._group_flags(self.group_id in verdict.differing, not verdict.ok)
        self.seconds += time.perf_counter() - t0
        if len(verdict.digests) > 1:
            self.checks += 1
        if not any_differs:
            return verdict
        self.mismatches += 1
        self.events.write(event="divergence", time=time.time(), step=step, primary_group=verdict.primary,
                          differing_groups=verdict.differing, digests={str(k): v for k, v in verdict.digests.items()},
                          action=self.action, this_group_differs=group_differs)
        logger.warning("DIVERGENCE after step %d: replica group(s) %s differ from the quorum's primary (group %s); "
                       "%s", step, verdict.differing or "of this group's other ranks", verdict.primary,
                       "they discard this step and heal from a peer at the next" if self.action == "heal"
                       else "stopping")
        if self.action == "stop":
            raise ReplicaDivergenceError(
                f"replica groups {verdict.differing} hold different parameters or optimizer state than the "
                f"quorum's primary (group {verdict.primary}) after step {step}; digests {verdict.digests}. "
                "Set FTBRIDGE_GUARD_ACTION=heal to repair instead of stopping")
        if group_differs:
            self.manager.report_error(RuntimeError(
                f"divergence guard: replica group {self.group_id} differs from the quorum's primary (group "
                f"{verdict.primary}) after step {step}; discarding this step to heal from a peer"))
        return verdict

    def _gather(self) -> Optional[Verdict]:
        digest = tensor_checksum(self.adapter.fingerprint_tensors())
        try:
            t = gather_rows(self.manager, encode_slot(self.group_id, digest))
        except Exception as e:  # noqa: BLE001 - a failed check is skipped, never fatal
            logger.warning("divergence guard skipped: its all-reduce failed (%s)", e)
            return None
        errored = getattr(self.manager, "errored", None)
        if errored is not None and errored() is not None:
            logger.warning("divergence guard skipped: its all-reduce failed (%s)", errored())
            return None
        return judge(decode_slots(t))

    def _group_flags(self, *mine: bool) -> tuple:
        """Each flag true on every rank of the group if it is true on any rank (one in-group MAX)."""
        if not dist.is_initialized() or dist.get_world_size(self.group) == 1:
            return tuple(mine)
        flags = torch.tensor([int(m) for m in mine], dtype=torch.int32,
                             device=collective_device(group_backend(self.group)))
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return tuple(bool(f) for f in flags.tolist())
