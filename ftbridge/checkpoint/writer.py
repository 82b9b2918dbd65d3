"""Who writes a checkpoint: replica rank 0 of the quorum that committed the step, a pure function.

Exactly one group writes each committed step (``docs/checkpoints.md``, "How it works": one writer per
step). At run time the replica rank comes from torchft (``Manager.participating_rank()``);
:func:`replica_ranks` restates torchft's rule so that the uniqueness can be tested without a lighthouse.
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional


def replica_ranks(members: Mapping[str, int]) -> Dict[str, Optional[int]]:
    """Replica rank of every quorum member, as torchft assigns it.

    Args:
        members: ``{replica_id: step}`` of every group in the quorum.

    Returns:
        ``{replica_id: rank}``: groups at the highest step, sorted by replica id, get 0..n-1; groups behind
        (healing this step) get ``None``.
    """
    if not members:
        return {}
    top = max(members.values())
    order = sorted(r for r, s in members.items() if s == top)
    ranks: Dict[str, Optional[int]] = {r: None for r in members}
    ranks.update({r: i for i, r in enumerate(order)})
    return ranks


def is_writer(replica_rank: Optional[int], committed: bool) -> bool:
    """Whether this group writes the step it just finished: replica rank 0 (``None``: healing) of a committed step."""
    return committed and replica_rank == 0


def save_due(step: int, every: int, *, requested: bool = False, stopping: bool = False) -> bool:
    """Whether the state after committed ``step`` (> 0) should be checkpointed.

    Args:
        step: committed steps so far (the checkpoint's step).
        every: save every N steps (0: never on a schedule).
        requested: an on-demand save was asked for (trigger file or API).
        stopping: a graceful stop (SIGTERM) ends the run after this step.
    """
    return step > 0 and (requested or stopping or (every > 0 and step % every == 0))
