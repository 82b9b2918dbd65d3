"""Healing a replica group from a live peer, in memory.

The package: this module's pure rules and bounds; :mod:`ftbridge.heal.wire`, the
pickle-free body format and its hostile-input decoder; :mod:`ftbridge.heal.stream`,
the body sent from the donor's tensors and the joiner's receive buffer;
:mod:`ftbridge.heal.limits`, deadlines, the bounded server, the URL policy and the
job-token HMAC. :mod:`ftbridge.manager.transport` plugs them into torchft's
checkpoint transport.

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


def restart_without_peer(*, restarted_empty: bool, all_members_empty: bool, waited_s: float, limit_s: float) -> str:
    """What a replica group that torchrun restarted with nothing to start from does in a step (pure).

    A restarted group with nothing to start from (torchft step 0, never healed, nothing resumed) heals
    from a member that holds the job's state. If no member of its quorum holds any (it is alone, or
    every member was restarted with nothing: right after a lighthouse restart, after the others finished,
    after every group died), training would start the job again from its initial model: a second,
    different model. It discards such steps while a peer may still come, and past the limit stops.

    Args:
        restarted_empty: this group was restarted by torchrun and has nothing to start from.
        all_members_empty: no member of this step's quorum holds the job's state (each was restarted with
            nothing; a group alone counts).
        waited_s: seconds since this launch's engine started.
        limit_s: ``FTBridgeConfig.restart_peer_wait`` in seconds (0: never wait, never stop).

    Returns:
        ``"go"`` (train), ``"wait"`` (discard this step) or ``"stop"`` (raise :class:`NoPeerToHealFrom`).
    """
    if not (restarted_empty and all_members_empty and limit_s > 0):
        return "go"
    return "wait" if waited_s < limit_s else "stop"
