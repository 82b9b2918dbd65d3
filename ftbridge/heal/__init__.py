"""Healing a replica group from a live peer, in memory: the pure rules and bounds (reasoning: ``docs/heal.md``).

Submodules: :mod:`ftbridge.heal.wire` (body format and decoder), :mod:`ftbridge.heal.stream` (sending
and receiving), :mod:`ftbridge.heal.limits` (deadlines, bounded server, URL policy, job token);
:mod:`ftbridge.manager.transport` plugs them into torchft.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


LAZY_STATE_FACTOR = 3
"""State tensors an optimizer may create per parameter at its first step (Adam's two plus AMSGrad's max)."""


def lazy_state_bytes(optimizer: Any) -> int:
    """Bytes of optimizer state a donor may hold that this rank does not have yet (``docs/heal.md``).

    :data:`LAZY_STATE_FACTOR` times the bytes of every parameter without state, plus 1 KiB each.
    ``optimizer``: a DeepSpeed optimizer (with ``.optimizer``), a ``torch.optim.Optimizer``, or ``None`` (0).
    """
    if optimizer is None:
        return 0
    base = getattr(optimizer, "optimizer", optimizer)
    params = [p for group in getattr(base, "param_groups", None) or [] for p in group["params"]]
    params += list(getattr(optimizer, "fp32_partitioned_groups_flat", None) or [])
    state = getattr(base, "state", {})
    total, seen = 0, set()
    for p in params:
        if id(p) not in seen and not state.get(p):
            total += LAZY_STATE_FACTOR * p.numel() * p.element_size() + 1024
        seen.add(id(p))
    return total


class NoPeerToHealFrom(RuntimeError):
    """A group that joined with nothing found no live peer to heal from in time."""


def joined_empty(*, restart_count: int, spare_index: int, num_replica_groups: int) -> bool:
    """Whether this launch joined a running job holding none of its state (pure).

    True for a torchrun restart (``restart_count``, ``TORCHELASTIC_RESTART_COUNT`` > 0) or a warm spare
    (``spare_index`` >= 0), never for a job of one replica group.
    """
    return num_replica_groups > 1 and (restart_count > 0 or spare_index >= 0)


def restart_without_peer(*, restarted_empty: bool, all_members_empty: bool, waited_s: float, limit_s: float) -> str:
    """What a group that joined with nothing does in a step (pure); see ``docs/heal.md``, "Restart without a peer".

    Args:
        restarted_empty: this group joined with nothing (:func:`joined_empty`) and has not healed or committed.
        all_members_empty: no member of this step's quorum holds the job's state (a group alone counts).
        waited_s: seconds since this launch's engine started.
        limit_s: ``FTBridgeConfig.restart_peer_wait`` in seconds (0: never wait, never stop).

    Returns:
        ``"go"`` (train), ``"wait"`` (discard this step) or ``"stop"`` (raise :class:`NoPeerToHealFrom`).
    """
    if not (restarted_empty and all_members_empty and limit_s > 0):
        return "go"
    return "wait" if waited_s < limit_s else "stop"
