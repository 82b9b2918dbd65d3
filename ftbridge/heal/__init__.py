"""Healing a replica group from a live peer, in memory.

The package: this module's pure rules and bounds; :mod:`ftbridge.heal.wire`, the
pickle-free body format and its hostile-input decoder; :mod:`ftbridge.heal.stream`,
the body sent from the donor's tensors and the joiner's receive buffer;
:mod:`ftbridge.heal.limits`, deadlines, the bounded server, the URL policy and the
job-token HMAC. :mod:`ftbridge.manager.transport` plugs them into torchft's
checkpoint transport.

* :func:`lazy_state_bytes`: how much optimizer state a donor may hold that a
  joiner does not have yet (the joiner's bound on a heal body);
* :func:`joined_empty`: whether this launch joined a running job with nothing
  of its state (a torchrun restart, or a warm spare that took a group's id);
* :func:`restart_without_peer`: whether such a group waits for a live peer, or
  stops, instead of training from scratch.

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
    """A replica group that joined with nothing to start from (restarted, or a spare) found no live peer to heal
    from in time."""


def joined_empty(*, restart_count: int, spare_index: int, num_replica_groups: int) -> bool:
    """Whether this launch joined a running job holding none of its state (pure).

    True for a launch torchrun restarted (``restart_count`` > 0) and for a warm spare that took a vacant
    group's id (``spare_index`` >= 0; :mod:`ftbridge.spare` takes an id only while another group lives).
    Until it heals or commits, such a group must not train alone (:func:`restart_without_peer`). A job of
    one replica group has nobody to heal from: its restart starts over or resumes from a checkpoint.

    Args:
        restart_count: ``TORCHELASTIC_RESTART_COUNT``.
        spare_index: ``FTBridgeConfig.spare_index`` (-1: not a spare).
        num_replica_groups: ``FTBridgeConfig.num_replica_groups``.
    """
    return num_replica_groups > 1 and (restart_count > 0 or spare_index >= 0)


def restart_without_peer(*, restarted_empty: bool, all_members_empty: bool, waited_s: float, limit_s: float) -> str:
    """What a replica group that joined with nothing to start from does in a step (pure).

    A group that joined with nothing (:func:`joined_empty`: torchft step 0, never healed, nothing resumed) heals
    from a member that holds the job's state. If no member of its quorum holds any (it is alone, or
    every member was restarted with nothing: right after a lighthouse restart, after the others finished,
    after every group died), training would start the job again from its initial model: a second,
    different model. It discards such steps while a peer may still come, and past the limit stops.

    Args:
        restarted_empty: this group joined with nothing (:func:`joined_empty`) and has not healed or committed.
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
