"""Healing a replica group: all of its ranks apply a peer's state, or none does.

torchft heals per rank: each group rank of a joining replica group fetches
the state of the same group rank in a healthy group (its ``recv_checkpoint``
runs on the quorum thread), and ``should_commit`` applies it. ftbridge's
load (:meth:`ftbridge.engine.FaultTolerantEngine.load_heal_state`) ends with
a collective inside the replica group (ZeRO-1/2 all-gather the updated
parameters; ZeRO-3 wraps the load in its checkpoint events), so either every
rank of the group loads, or none may.

If the donor dies half-way through a transfer, some ranks of the joiner may
hold a complete state and others none. Left alone, the ranks that received
would enter the group's collective while the others go to ``should_commit``:
the group hangs until the in-group timeout kills it. :func:`agree_on_heal`
prevents that with one small all-reduce inside the group, only in a step that
heals: if any rank failed to receive, every rank drops what it received and
records an error, so the step is discarded everywhere and the next quorum
heals again (from another healthy group if the donor is gone).

torchft also loads its own counters (``step``, ``batches_committed``) from
the donor on the quorum thread, as soon as a rank's fetch succeeds. A
dropped heal must take those back too, or the ranks of the group report
different steps: the rank that received would claim the donor's step, the
group would skip the next heal and commit with its stale model.
:func:`guard_heal` remembers the counters before torchft overwrites them.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.distributed as dist

from ftbridge.device import collective_device, group_backend

logger = logging.getLogger(__name__)


def guard_heal(manager: Any) -> None:
    """Let :func:`agree_on_heal` undo torchft's own counters after a dropped heal.

    Wraps ``load_state_dict`` on the ``torchft.Manager`` instance (torchft
    0.2 calls it on the quorum thread right after a successful fetch) so the
    counters it replaces are kept. ``None`` (no torchft manager) is ignored.
    """
    if manager is None:
        return
    original = manager.load_state_dict

    def load_state_dict(state: Any) -> None:
        manager._ftbridge_before_heal = manager.state_dict()
        original(state)

    manager.load_state_dict = load_state_dict
    manager._ftbridge_load_counters = original


def agree_on_heal(manager: Any, group: Optional[Any] = None) -> bool:
    """Make the ranks of one replica group agree whether this step's heal state may be applied.

    Call on every rank of the group right before ``should_commit``. Reads
    torchft 0.2 ``Manager`` internals (``_healing``, ``_pending_state_dict``):
    there is no public API for "did this rank's fetch succeed".

    Args:
        manager: the rank's ``torchft.Manager``.
        group: the replica group's process group (default: the default world,
            which ftbridge makes the replica group).

    Returns:
        ``True`` if this step does not heal, or every rank of the group holds
        its complete heal state; ``False`` if any rank failed, in which case
        this rank's received state is dropped and an error is reported to
        torchft (the step is discarded on every replica), and torchft's step
        and batch counters are put back to their values before the heal
        (needs :func:`guard_heal` installed).
    """
    if not getattr(manager, "_healing", False):
        return True
    manager.wait_quorum()  # the fetch runs on torchft's quorum thread
    ok = getattr(manager, "_pending_state_dict", None) is not None and manager.errored() is None
    flag = torch.tensor([int(ok)], dtype=torch.int32, device=collective_device(group_backend(group)))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    before, manager._ftbridge_before_heal = getattr(manager, "_ftbridge_before_heal", None), None
    if flag.item():
        return True
    manager._pending_state_dict = None
    if before is not None:  # torchft already took the donor's step: take it back
        manager._ftbridge_load_counters(before)
    if ok:
        manager.report_error(RuntimeError(
            "another rank of this replica group did not receive its heal state (its donor died or the "
            "transfer broke); no rank applies a heal this step, the next quorum heals again"))
        logger.warning("heal dropped: another rank of this replica group failed to receive its state")
    return False


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


def must_wait_for_peer(*, restart_count: int, num_replica_groups: int, step: int, heals: int, participants: int,
                       waited_s: float, limit_s: float) -> bool:
    """Whether a restarted replica group must discard this step and wait for a peer to heal from.

    A group that torchrun restarted and that has nothing to start from (torchft
    step 0, never healed, nothing resumed) would otherwise train from the
    initial model whenever a quorum holds only itself: for instance right
    after a lighthouse restart, before the other groups' managers are back
    in the quorum. Pure function (the caller passes the clock).

    Args:
        restart_count: ``TORCHELASTIC_RESTART_COUNT`` (0: first launch).
        num_replica_groups: planned replica groups of the job.
        step: torchft's step of this replica (0: nothing loaded).
        heals: heals applied in this launch.
        participants: replica groups in this step's quorum.
        waited_s: seconds since this launch's engine started.
        limit_s: ``FTBridgeConfig.restart_peer_wait`` in seconds.
    """
    return (restart_count > 0 and num_replica_groups > 1 and step == 0 and heals == 0 and participants <= 1
            and waited_s < limit_s)
