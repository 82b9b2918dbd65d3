"""The spare benchmark's pure parts: full capacity back and the spare's phases (ftbridge.harness.bench.spare)."""

import pytest

from ftbridge.harness.bench.spare import SPARE_PHASES, capacity_back, spare_phases


def step(t, committed=True, participants=2, healed=False):
    return {"time": t, "step": int(t), "committed": committed, "participants": participants, "healed": healed}


KILL = 100.0
EVENTS = [
    step(99.0), step(100.01),                                    # the killed process, even just after the kill
    {"event": "spare_join", "time": 102.0, "vacancy_seen": 101.95},
    {"event": "start", "time": 102.05},
    {"event": "heal_transfer", "start": 102.1, "time": 102.2},
    step(102.3, participants=1, healed=True),                    # healing step: not full capacity
    step(102.4, committed=False),                                # discarded
    step(102.5),                                                 # full capacity
    step(102.6),
]


def test_full_capacity_is_the_replacements_first_committed_step_with_every_group_contributing():
    assert capacity_back(EVENTS, KILL)["time"] == 102.5
    assert capacity_back(EVENTS, KILL, healed=True)["time"] == 102.3


def test_no_restart_after_the_kill_means_no_capacity_back():
    with pytest.raises(ValueError, match="no full-capacity step"):
        capacity_back(EVENTS[:2], KILL)


def test_spare_phases_tile_drop_to_full_capacity():
    phases = spare_phases(EVENTS, drop_time=101.9, kill_time=KILL)
    assert list(phases) == list(SPARE_PHASES)
    assert sum(phases.values()) == pytest.approx(102.5 - 101.9)
    assert phases["status poll"] == pytest.approx(0.05) and phases["state transfer"] == pytest.approx(0.1)


def test_missing_join_is_named():
    with pytest.raises(ValueError, match="spare_join"):
        spare_phases([e for e in EVENTS if e.get("event") != "spare_join"], 101.9, KILL)


def test_with_slots_the_discarded_heal_step_ends_the_heal_phase():
    slots = [e if not e.get("healed") else {**e, "committed": False, "participants": 2} for e in EVENTS]
    phases = spare_phases(slots, drop_time=101.9, kill_time=KILL)
    assert phases["heal step"] == pytest.approx(0.1)
    assert sum(phases.values()) == pytest.approx(102.5 - 101.9)
