"""Who writes a checkpoint: a pure function of the committed quorum.

A step is committed by exactly one quorum (torchft's ``should_commit`` is a
vote of that quorum's participants), and every group in it sees the same
quorum, so "replica rank 0 of the quorum that committed the step" names
exactly one replica group per step. Groups that healed in that step are not
participants (torchft gives them no replica rank) and never write. When the
writer group dies before committing a step, the step is discarded and retried
in the next quorum, whose replica rank 0 writes it instead.

:func:`replica_ranks` restates torchft's rule (participants at the quorum's
highest step, ordered by replica id, ranked 0..n-1) so that the uniqueness
can be tested without a lighthouse; at run time the rank comes from torchft
(``Manager.participating_rank()``) and only :func:`is_writer` /
:func:`save_due` decide.
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional


def replica_ranks(members: Mapping[str, int]) -> Dict[str, Optional[int]]:
    """Replica rank of every quorum member, as torchft assigns it.

    Args:
        members: ``{replica_id: step}`` of every group in the quorum.

    Returns:
        ``{replica_id: rank}``: the groups at the highest step, sorted by
        replica id, get ranks 0..n-1; groups behind (they heal this step) get
        ``None``.
    """
    if not members:
        return {}
    top = max(members.values())
    order = sorted(r for r, s in members.items() if s == top)
    ranks: Dict[str, Optional[int]] = {r: None for r in members}
    ranks.update({r: i for i, r in enumerate(order)})
    return ranks


def is_writer(replica_rank: Optional[int], committed: bool) -> bool:
    """Whether this group writes the checkpoint of the step it just finished.

    Args:
        replica_rank: this group's rank in the step's quorum (``None``: healing).
        committed: whether the step was committed.

    Returns:
        True only for replica rank 0 of a committed step.
    """
    return committed and replica_rank == 0


def save_due(step: int, every: int, *, requested: bool = False, stopping: bool = False) -> bool:
    """Whether the state after committed ``step`` should be checkpointed.

    Args:
        step: committed steps so far (the checkpoint's step).
        every: save every N steps (0: never on a schedule).
        requested: an on-demand save was asked for (trigger file or API).
        stopping: a graceful stop (SIGTERM) ends the run after this step.

    Returns:
        True when the step is on the schedule or a save was asked for.
    """
    return step > 0 and (requested or stopping or (every > 0 and step % every == 0))
