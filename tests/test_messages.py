"""The cross-replica message plan: tiling, order, and readiness (pure functions, no DeepSpeed)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftbridge.zero.layout import Fragment, PartitionLayout
from ftbridge.zero.messages import Readiness, plan_messages


def _layout(sizes, gaps):
    frags, off = [], 0
    for key, (n, gap) in enumerate(zip(sizes, gaps)):
        off += gap
        frags.append(Fragment(off, n, (n,), 0, key))
        off += n
    return PartitionLayout(off + gaps[-1], frags)


layouts = st.integers(1, 8).flatmap(lambda k: st.tuples(st.lists(st.integers(0, 9), min_size=k, max_size=k),
                                                        st.lists(st.integers(0, 3), min_size=k, max_size=k)))


@settings(max_examples=200, deadline=None)
@given(shape=layouts, min_numel=st.integers(-1, 40))
def test_messages_tile_the_partition_and_hold_whole_fragments(shape, min_numel):
    layout = _layout(*shape)
    plan = plan_messages(layout, min_numel)
    if layout.numel == 0:
        assert plan == []
        return
    spans = sorted((m.start, m.end) for m in plan)
    assert spans[0][0] == 0 and spans[-1][1] == layout.numel
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), "gap or overlap between messages"
    assert [m.start for m in plan] == sorted((m.start for m in plan), reverse=True), "not last-first"
    for f in layout.fragments:
        if f.numel:
            holders = [m for m in plan if f in m.fragments]
            assert len(holders) == 1 and holders[0].start <= f.offset and f.offset + f.numel <= holders[0].end
    assert all(m.numel >= min_numel for m in plan[:-1])


def test_readiness_issues_in_plan_order_whatever_the_arrival():
    plan = plan_messages(_layout([4, 4, 4], [0, 0, 0]), 0)  # messages: key 2, key 1, key 0
    r = Readiness(plan)
    assert [m.keys for m in plan] == [(2,), (1,), (0,)]
    assert r.reduced([0]) == []          # message 2 complete, but 0 and 1 have not gone
    assert r.reduced([2]) == [0]
    assert r.reduced([7, 2]) == []       # unknown keys and repeats are ignored
    assert r.reduced([1]) == [1, 2]
    assert r.rest() == []


def test_readiness_rest_sends_what_got_no_gradient():
    plan = plan_messages(_layout([4, 4, 4], [0, 0, 0]), 0)
    r = Readiness(plan)
    assert r.reduced([2]) == [0]
    assert r.rest() == [1, 2]            # parameters 0 and 1 got no gradient this step: zeros, still sent
    r.reset()
    assert r.reduced([2, 1, 0]) == [0, 1, 2]


@pytest.mark.parametrize("min_numel,expect", [(0, 3), (5, 2), (100, 1)])
def test_min_numel_coalesces_fragments(min_numel, expect):
    assert len(plan_messages(_layout([4, 4, 4], [0, 0, 0]), min_numel)) == expect
