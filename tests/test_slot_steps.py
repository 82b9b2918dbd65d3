"""The engine's side of slots (ftbridge.slots.steps): the units of an attempt, the boundary, the refusals.

One real DeepSpeed rank with a scripted manager (tests/fakes.py): the manager says who is in the
step's quorum; the tests check which units the group computes, that DeepSpeed steps once after the
last of them, that the cross-replica divisor is the slots, and that a heal step is discarded.
"""

from __future__ import annotations

import pytest

from ftbridge.slots import assign
from ftbridge.slots.steps import StepNotCovered, participants_of
from tests.fakes import FakeManager, gpt_batch, tiny_engine

pytestmark = pytest.mark.usefixtures("single_rank_world")

IDS = {g: f"replica_group_{g}:uuid{g}" for g in range(4)}


class QuorumOf(FakeManager):
    """A fake manager whose quorum holds ``members`` (replica group ids), ``everyone`` taking part."""

    members = (0, 1, 2)
    everyone = True

    def step_members(self):
        return tuple(IDS[g] for g in self.members), self.everyone


def _step(engine):
    """Train one step through ``units()``; returns the units and the boundary DeepSpeed saw at each."""
    seen = []
    for unit in engine.units():
        seen.append(((unit.slot, unit.micro), bool(engine.engine.is_gradient_accumulation_boundary())))
        assert (unit.step, unit.group_rank, unit.group_size, unit.slots) == (int(engine.global_steps), 0, 1, 3)
        assert unit.dp_rank == unit.slot and unit.dp_world_size == 3
        x, y = gpt_batch(10 * unit.slot + unit.micro)
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
    return seen


def test_participants_come_from_the_quorum_and_refuse_what_cannot_be_covered():
    assert participants_of([IDS[2], IDS[0]], True, 3) == ([0, 2], "")
    assert participants_of([IDS[0], IDS[1]], False, 3)[1].startswith("a member heals")
    assert "not all replica groups" in participants_of([IDS[3]], True, 3)[1]
    assert "two quorum members" in participants_of([IDS[1], "replica_group_1:other"], True, 3)[1]
    assert "unknown" in participants_of([], True, 3)[1]


@pytest.mark.parametrize("members,expected", [
    ((0, 1, 2), [(0, 0), (0, 1)]),          # every group live: its own slot only
    ((0, 2), [(0, 0), (0, 1), (1, 0)]),     # group 1 absent: one of its units, the other to group 2
    ((0,), [(s, m) for s in range(3) for m in range(2)]),  # alone: the whole grid
])
def test_a_group_computes_its_slot_then_the_absent_groups_units_and_steps_once(members, expected):
    manager = type("M", (QuorumOf,), {"members": members})
    engine = tiny_engine(2, manager=manager, ds={"gradient_accumulation_steps": 2},
                         ft={"slots": 3, "num_replica_groups": 3, "replica_group_id": 0})
    assert expected == list(assign(3, 2, 3, members)[0])
    seen = _step(engine)
    assert [u for u, _ in seen] == expected
    assert [b for _, b in seen] == [False] * (len(expected) - 1) + [True]
    assert engine.last_committed is True and int(engine.global_steps) == 1
    assert engine.slot_plan == expected
    assert engine.sync.hook_state.divisor == 3  # the cross-replica sum is divided by the slots


def test_a_step_in_which_a_member_heals_is_discarded_after_the_home_units_and_tried_again():
    manager = type("M", (QuorumOf,), {"members": (0, 1), "everyone": False})
    engine = tiny_engine(2, manager=manager, ds={"gradient_accumulation_steps": 2},
                         ft={"slots": 3, "num_replica_groups": 3, "replica_group_id": 0})
    errors, report = [], engine.manager.report_error
    engine.manager.report_error = lambda e: (errors.append(e), report(e))
    seen = _step(engine)
    assert [u for u, _ in seen] == [(0, 0), (0, 1)]
    assert seen[-1][1] is True
    assert [type(e) for e in errors] == [StepNotCovered]
    assert engine.last_committed is False and int(engine.global_steps) == 0


def test_without_slots_units_are_the_groups_own_micro_batches():
    engine = tiny_engine(2, ds={"gradient_accumulation_steps": 3},
                         ft={"num_replica_groups": 2, "replica_group_id": 1})
    units = []
    for unit in engine.units():
        units.append((unit.slot, unit.micro, unit.dp_rank, unit.dp_world_size))
        _, loss = engine(*gpt_batch(unit.micro))
        engine.backward(loss)
    engine.step()  # once after the loop: the boundary stays set on the last unit
    assert units == [(1, 0, 1, 2), (1, 1, 1, 2), (1, 2, 1, 2)]
    assert engine.last_committed is True and int(engine.global_steps) == 1
    assert engine.sync.hook_state.divisor == 1  # the participants (one, alone), as without units()


def test_with_slots_a_training_forward_outside_units_is_refused():
    engine = tiny_engine(2, manager=QuorumOf, ft={"slots": 3, "num_replica_groups": 3})
    with pytest.raises(RuntimeError, match=r"inside 'for unit in engine.units\(\)"):
        engine(*gpt_batch(0))


def test_units_inside_a_step_is_refused():
    engine = tiny_engine(2)
    engine(*gpt_batch(0))
    with pytest.raises(RuntimeError, match="inside a step"):
        next(iter(engine.units()))


@pytest.mark.parametrize("stage,ds,hook,match", [
    (1, {"gradient_accumulation_steps": 1, "zero_optimization": {"overlap_comm": True}}, None, "overlap_comm"),
    (2, {}, "power_sgd", "PowerSGD"),
])
def test_settings_slots_cannot_keep_are_refused_at_initialize(stage, ds, hook, match):
    ft = {"slots": 2, "num_replica_groups": 2, **({"comm_hook": hook} if hook else {})}
    with pytest.raises(ValueError, match=match):
        tiny_engine(stage, ds=ds, ft=ft)


@pytest.mark.parametrize("fields,match", [
    ({"slots": 1, "num_replica_groups": 2}, "fewer than num_replica_groups"),
    ({"slots": 2, "num_replica_groups": 2, "init_sync": True}, "init_sync"),
])
def test_slot_settings_are_checked(fields, match):
    from ftbridge.config import FTBridgeConfig

    with pytest.raises(ValueError, match=match):
        FTBridgeConfig.resolve(environ={}, **fields)
    assert FTBridgeConfig.resolve(environ={"FTBRIDGE_SLOTS": "3"}, num_replica_groups=2).slots == 3


def test_the_divisor_is_the_slots_only_for_a_mean():
    from ftbridge.comm_hooks.base import CommHookState

    state = CommHookState(FakeManager.__new__(FakeManager), reduction="sum")
    state.slots = 4
    assert state.divisor == 1
    state = CommHookState(type("P", (), {"participants": 2})())
    assert state.divisor == 2
    state.slots = 4
    assert state.divisor == 4


def test_the_engine_says_in_its_log_that_slots_are_on(caplog):
    with caplog.at_level("INFO", logger="ftbridge.engine"):
        tiny_engine(2, ds={"gradient_accumulation_steps": 2}, manager=QuorumOf,
                    ft={"num_replica_groups": 3, "replica_group_id": 0, "slots": 3})
    assert "slots on: 3 slots of 2 micro-batch(es) each per optimizer step" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="ftbridge.engine"):
        tiny_engine(2, ft={"num_replica_groups": 2, "replica_group_id": 1})
    assert "slots on" not in caplog.text


def test_a_step_with_an_error_recorded_at_its_quorum_computes_no_absent_groups_units():
    """A quorum that cannot commit (the quorum guard recorded an error, as for a lone quorum right after a
    lighthouse restart) is discarded after the home units: the absent groups' units would be thrown away."""
    class ErroredAtQuorum(QuorumOf):
        members = (0,)

        def step_members(self):
            self.report_error(RuntimeError("quorum 1 after a lighthouse restart holds one group\nmore"))
            return super().step_members()

    engine = tiny_engine(2, manager=ErroredAtQuorum, ds={"gradient_accumulation_steps": 2},
                         ft={"slots": 3, "num_replica_groups": 3, "replica_group_id": 0})
    seen = _step(engine)
    assert [u for u, _ in seen] == [(0, 0), (0, 1)], "the whole grid was computed for a step that cannot commit"
    assert seen[-1][1] is True
    assert engine.last_committed is False and int(engine.global_steps) == 0
