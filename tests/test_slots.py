"""The slot plan (ftbridge.slots): every unit once, homes kept, load bounded; the settings digest."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftbridge import slots as sl

pytestmark = pytest.mark.timeout(120)


def _grid(n, g):
    return [(s, m) for s in range(n) for m in range(g)]


def _check_plan(n, g, m, present):
    plan = sl.assign(n, g, m, present)
    assert sorted(plan) == sorted(present)
    every = [u for units in plan.values() for u in units]
    assert Counter(every) == Counter(_grid(n, g)), "each unit exactly once"
    for gid, units in plan.items():
        home = sl.home_units(n, g, m, gid)
        assert list(units[:len(home)]) == home, "home units first and unchanged"
        assert len(units) <= sl.max_load(n, g, len(present)), (gid, len(units))
    return plan


def test_every_small_grid_and_participant_set_is_covered_once_and_balanced():
    # Exhaustive: N <= 6 slots, G in {1, 2, 3}, every number of groups M <= N, every non-empty participant set.
    for n in range(1, 7):
        for g in (1, 2, 3):
            for m in range(1, n + 1):
                for k in range(1, m + 1):
                    for present in itertools.combinations(range(m), k):
                        _check_plan(n, g, m, present)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.data())
def test_larger_grids_hold_the_same_properties(data):
    n = data.draw(st.integers(1, 32))
    g = data.draw(st.integers(1, 8))
    m = data.draw(st.integers(1, n))
    present = data.draw(st.lists(st.integers(0, m - 1), min_size=1, max_size=m, unique=True))
    plan = _check_plan(n, g, m, present)
    assert sl.assign(n, g, m, list(reversed(present))) == plan, "independent of the participants' order"


def test_with_every_group_present_each_computes_its_own_slot():
    plan = sl.assign(4, 2, 4, range(4))
    assert plan == {gid: ((gid, 0), (gid, 1)) for gid in range(4)}


def test_orphans_go_to_the_least_loaded_then_the_lowest_id():
    # 4 slots, G=1, group 1 absent: its one unit goes to group 0 (all tied at 1, lowest id).
    assert sl.assign(4, 1, 4, [0, 2, 3]) == {0: ((0, 0), (1, 0)), 2: ((2, 0),), 3: ((3, 0),)}
    # G=2, groups 1 and 2 absent of 4: four orphan units spread over groups 0 and 3, two each.
    plan = sl.assign(4, 2, 4, [0, 3])
    assert plan[0] == ((0, 0), (0, 1), (1, 0), (2, 0)) and plan[3] == ((3, 0), (3, 1), (1, 1), (2, 1))


def test_fewer_groups_than_slots_split_the_grid_in_contiguous_balanced_blocks():
    # 5 slots x 3 micro-batches on 3 groups: 5 units each, a slot may span two groups.
    homes = [sl.home_units(5, 3, 3, gid) for gid in range(3)]
    assert [len(h) for h in homes] == [5, 5, 5]
    assert homes[0] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]


def test_refusals_name_the_value_and_the_fix():
    with pytest.raises(ValueError, match="num_replica_groups=3 is more than slots=2.*slots >= 3"):
        sl.assign(2, 1, 3, [0])
    with pytest.raises(ValueError, match="slots=0"):
        sl.home_units(0, 1, 1, 0)
    with pytest.raises(ValueError, match="gradient_accumulation_steps=0"):
        sl.assign(2, 0, 2, [0])
    with pytest.raises(ValueError, match="no participating"):
        sl.assign(2, 1, 2, [])
    with pytest.raises(ValueError, match="repeat"):
        sl.assign(2, 1, 2, [1, 1])
    with pytest.raises(ValueError, match=r"outside replica groups \[0, 2\)"):
        sl.assign(2, 1, 2, [2])


def test_a_unit_reads_the_rows_of_its_failure_free_rank_and_seeds_by_its_coordinates():
    u = sl.Unit(step=7, slot=2, micro=1, group_rank=1, group_size=2, slots=3)
    assert (u.dp_rank, u.dp_world_size) == (5, 6)
    same = sl.Unit(step=7, slot=2, micro=1, group_rank=1, group_size=2, slots=3)
    assert u.seed(0) == same.seed(0) == sl.unit_seed(0, 7, 5, 1) and 0 <= u.seed(0) < 2 ** 63
    others = [dict(step=8), dict(slot=1), dict(micro=0), dict(group_rank=0)]
    seeds = {sl.Unit(**{**vars(u), **o}).seed(0) for o in others} | {u.seed(0), u.seed(1)}
    assert len(seeds) == 6


def test_the_config_digest_differs_for_every_setting_it_covers():
    base = (3, 2, 8, 1, 0)
    digests = {sl.config_digest(*base)} | {sl.config_digest(*(base[:i] + (base[i] + 1,) + base[i + 1:]))
                                           for i in range(len(base))}
    assert len(digests) == 6 and all(0 <= d < 2 ** sl.DIGEST_BITS for d in digests)
