"""The engine's side of slots: :func:`units` implements :meth:`ftbridge.engine.FaultTolerantEngine.units`,
one attempt of a step unit by unit (home units, then one plan for the whole group, :func:`group_plan`,
and DeepSpeed's accumulation boundary true on the last unit); a step in which a member heals is discarded
everywhere (:class:`StepNotCovered`). With ``slots`` 0 it yields the group's own micro-batches.
Usage: docs/your-script.md; why: docs/design.md, "Failure-transparent training: the slot plan".
"""

from __future__ import annotations

import logging
from typing import Any, Iterator, List, Sequence, Tuple

from ftbridge.device import exchange_in_group
from ftbridge.manager.heal_agreement import DiscardStep
from ftbridge.manager.lighthouse_status import replica_group_of
from ftbridge.slots import Unit, UnitKey, assign, config_digest, home_units

logger = logging.getLogger(__name__)


class StepNotCovered(DiscardStep):
    """This attempt cannot train every unit of the step exactly once: the step is discarded everywhere (a heal received
    in it still applies)."""


def _discard(manager: Any, reason: str) -> None:
    """Record :class:`StepNotCovered` unless an error is recorded already."""
    if manager.errored() is None:
        manager.report_error(StepNotCovered(reason))


def participants_of(members: Sequence[str], everyone: bool, groups: int) -> Tuple[List[int], str]:
    """The sorted replica group ids whose units count this step, and ``""``; or ``([], reason)`` when the quorum is
    unknown, ``everyone`` is false (a member heals), an id of ``members`` is not a group in ``[0, groups)``, or two
    members hold one id (pure)."""
    if not members:
        return [], "the step's quorum is unknown (its quorum call failed)"
    if not everyone:
        return [], "a member heals in this step and torchft counts its gradient for nothing"
    ids = [replica_group_of(m) for m in members]
    if any(g is None or not 0 <= g < groups for g in ids):
        return [], f"quorum members {list(members)} are not all replica groups 0..{groups - 1}"
    if len(set(ids)) != len(ids):
        return [], f"two quorum members hold one replica group id ({list(members)})"
    return sorted(g for g in ids if g is not None), ""


def group_plan(manager: Any, slots: int, micro: int, groups: int, group: int) -> Tuple[List[UnitKey], str]:
    """The units this group computes after its home units, with group rank 0's view taken by every rank.

    Returns:
        ``(extra units in order, "")``, or ``([], reason)`` when the step is discarded (every rank has then
        recorded an error): the quorum is unusable (:func:`participants_of`), or group rank 0 has an error
        recorded already (a step that cannot commit computes no other group's units).

    Raises:
        RuntimeError: the in-group exchange failed.
    """
    members, everyone = manager.step_members()
    present, why = participants_of(members, everyone, groups)
    error = manager.errored()
    if not why and error is not None:  # e.g. the quorum lacks the majority after a lighthouse restart
        first = (str(error).splitlines() or [type(error).__name__])[0][:200]
        why = (f"an error is already recorded in this step, which is discarded everywhere ({first}): the absent "
               "groups' units are not computed")
    row = [0.0 if why else 1.0] + [1.0 if g in present else 0.0 for g in range(groups)]
    decided = exchange_in_group(row)[0]
    if decided != row:
        _discard(manager, "this rank's quorum differs from its group rank 0's")
    if decided[0] != 1.0:
        reason = why or "group rank 0 found the step's quorum unusable"
        _discard(manager, reason)
        return [], reason
    present = [g for g in range(groups) if decided[1 + g] == 1.0]
    if group not in present:
        reason = f"replica group {group} is not among the step's participants {present}"
        _discard(manager, reason)
        return [], reason
    home = home_units(slots, micro, groups, group)
    return list(assign(slots, micro, groups, present)[group][len(home):]), ""


def units(engine: Any) -> Iterator[Unit]:
    """Yield one attempt of the current step as :class:`ftbridge.slots.Unit` s of ``engine`` (between steps), home units
    first, the accumulation boundary set for each.

    Raises:
        RuntimeError: called inside a step (a forward ran since the last optimizer step).
    """
    if engine._in_step:
        raise RuntimeError("units() called inside a step: a forward has run since the last optimizer step; "
                           "iterate units() once per step, with every forward and backward inside the loop")
    cfg, ds = engine.cfg, engine.engine
    groups, micro = cfg.num_replica_groups, int(ds.gradient_accumulation_steps())
    slots = cfg.slots or groups
    home = home_units(slots, micro, groups, cfg.replica_group_id)
    engine._begin_step()
    step = int(ds.global_steps)
    plan: List[UnitKey] = list(home)
    engine.slot_plan = plan
    i = 0
    while i < len(plan):
        if cfg.slots and i == len(home) - 1:
            extra, why = group_plan(engine.manager, slots, micro, groups, cfg.replica_group_id)
            if why and cfg.group_rank == 0:
                logger.warning("[replica %d rank %d step %d] the step is discarded and tried again: %s",
                               cfg.replica_group_id, cfg.group_rank, step, why)
            plan = plan + extra
            engine.slot_plan = plan
        ds.set_gradient_accumulation_boundary(i == len(plan) - 1)
        slot, m = plan[i]
        yield Unit(step=step, slot=slot, micro=m, group_rank=cfg.group_rank, group_size=cfg.group_size,
                   slots=slots)
        i += 1


def plan_digest(cfg: Any, ds: Any) -> int:
    """:attr:`ftbridge.manager.commit.View.plan`: 0 without slots, else 1 + :func:`ftbridge.slots.config_digest` of the
    slots, accumulation steps, micro-batch and group size."""
    if not cfg.slots:
        return 0
    return 1 + config_digest(cfg.slots, int(ds.gradient_accumulation_steps()),
                             int(ds.train_micro_batch_size_per_gpu()), cfg.group_size, 0)


def refusal(cfg: Any, ds: Any, adapter: Any, hook_state: Any) -> str:
    """Why this engine (``cfg``, DeepSpeed engine ``ds``, its ``adapter`` and comm ``hook_state``) cannot train with
    slots, or ``""``; checked at ``initialize``."""
    if not cfg.slots:
        return ""
    from ftbridge.comm_hooks.powersgd import PowerSGDState

    if adapter.accumulation_refused():
        return (f"slots={cfg.slots}: a group computes several units in a step after a failure, and here "
                f"DeepSpeed cannot accumulate them: {adapter.accumulation_refused()}")
    if not ds.managed_gradient_accumulation():
        return (f"slots={cfg.slots} with managed_gradient_accumulation false: ftbridge sets the accumulation "
                "boundary itself on the step's last unit; remove that setting")
    if isinstance(hook_state, PowerSGDState):
        return (f"slots={cfg.slots} with a PowerSGD hook: its error feedback is kept per replica group, so a "
                "group's death changes the trained model; use no hook, fp16 or bf16, or FTBRIDGE_SLOTS=0")
    return ""
