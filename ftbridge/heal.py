"""Healing a replica group: pure rules and bounds.

* :func:`lazy_state_bytes`: how much optimizer state a donor may hold that a
  joiner does not have yet (the joiner's bound on a heal body);
* :func:`restart_without_peer`: whether a restarted group with nothing to
  start from waits for a live peer, or stops, instead of training from scratch.

The agreement that all ranks of a group apply a heal together or not at all
touches torchft's internals and lives behind the manager
(:class:`ftbridge.manager.HealAgreement`).
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


LAZY_STATE_FACTOR = 3
"""Optimizer state tensors a parameter may gain at its first step, each of the parameter's size:
Adam's moments plus AMSGrad's maximum (RMSprop and NAdam also keep at most three)."""


def lazy_state_bytes(optimizer: Any) -> int:
    """Bytes of optimizer state a donor may hold that this rank does not have yet (bytes).

    ``BF16_Optimizer``, ZeRO-3 and plain torch optimizers create their state
    at the first step, so a joiner restarted at step 0 holds a third of the
    donor's state; its own state alone would be too small a bound for the
    heal body. Counts :data:`LAZY_STATE_FACTOR` times the bytes of every
    parameter without state, plus 1 KiB of header per such parameter.

    Args:
        optimizer: a DeepSpeed optimizer wrapping a torch optimizer
            (``.optimizer``), or a ``torch.optim.Optimizer``; ``None``: 0.
            ZeRO-3 empties the torch optimizer's ``param_groups`` between
            steps, so its ``fp32_partitioned_groups_flat`` are counted too.
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
    """A restarted replica group with nothing to start from found no live peer to heal from in time."""


def restart_without_peer(*, restart_count: int, num_replica_groups: int, step: int, heals: int, participants: int,
                         waited_s: float, limit_s: float) -> str:
    """What a restarted replica group with nothing to start from does in a step where it is alone (pure).

    A group that torchrun restarted and that has nothing to start from (torchft
    step 0, never healed, nothing resumed) would otherwise train from the
    initial model whenever a quorum holds only itself: right after a lighthouse
    restart, before the other groups are back, or after the others finished.
    It discards such steps while a peer may still come; past the limit the
    others have finished or died, and training alone would make a second,
    different model of the job: the group stops.

    Args:
        restart_count: ``TORCHELASTIC_RESTART_COUNT`` (0: first launch).
        num_replica_groups: planned replica groups of the job.
        step: torchft's step of this replica (0: nothing loaded).
        heals: heals applied in this launch.
        participants: replica groups in this step's quorum.
        waited_s: seconds since this launch's engine started.
        limit_s: ``FTBridgeConfig.restart_peer_wait`` in seconds (0: never wait, never stop).

    Returns:
        ``"go"`` (train), ``"wait"`` (discard this step) or ``"stop"`` (raise :class:`NoPeerToHealFrom`).
    """
    if not (restart_count > 0 and num_replica_groups > 1 and step == 0 and heals == 0 and participants <= 1
            and limit_s > 0):
        return "go"
    return "wait" if waited_s < limit_s else "stop"
