"""Who writes a checkpoint: replica rank 0 of the quorum that committed the step (``docs/checkpoints.md``).

At run time the rank comes from torchft; :func:`replica_ranks` restates torchft's rule for tests.
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional


def replica_ranks(members: Mapping[str, int]) -> Dict[str, Optional[int]]:
    """``{replica_id: rank}`` as torchft assigns it from ``{replica_id: step}``: groups at the highest step,
    sorted by id, get 0..n-1; groups behind (healing) get ``None``.
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
    """Whether the state after committed ``step`` (> 0) should be saved: on the ``every`` schedule (0:
    none), ``requested`` on demand, or ``stopping`` after a SIGTERM.
    """
    return step > 0 and (requested or stopping or (every > 0 and step % every == 0))
