"""Quorums issued to a timed-out try of a group's quorum call (ftbridge/manager/unseen.py): read from the lighthouse's
status, recorded as dead ends, shared with the group's other ranks; and the rider's tries that read it."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import pytest

from ftbridge.manager.commit import ROW, ROW_OK, Agreement, continuous
from ftbridge.manager.history import QuorumHistory
from ftbridge.manager.lighthouse_status import StatusFormatError
from ftbridge.manager.unseen import MAX_SHARED, UnseenQuorums, decode_ids, encode_ids, unseen_quorum
from tests.test_outage import Quorum, Store, Tries, _rider, ask_as_a_group_of_two

pytestmark = pytest.mark.timeout(60)

ME, PEER, PEER_AGAIN = "replica_group_0:a", "replica_group_1:b", "replica_group_1:c"
OK_ROWS = [[1.0 if i == ROW_OK else 0.0 for i in range(ROW)]] * 2
"""Both members' rows ok: both committed the certifying step."""


def _status(qid, *members):
    return SimpleNamespace(previous_quorum_id=qid, members=[SimpleNamespace(replica_id=m) for m in members])


@pytest.mark.parametrize("previous, members, last, expected", [
    (14, [ME], 13, 14),                  # issued to this group alone after the last quorum it got
    (14, [ME, PEER], 13, 14),
    (14, [PEER], 13, None),              # a quorum without this group: others' history, not this one's
    (14, ["replica_group_0:z"], 13, None),  # this group's id from another launch (a restart): not this process
    (13, [ME], 13, None),                # the quorum this rank holds
    (12, [ME], 13, None),                # older (or a restarted lighthouse's)
    (None, [], 13, None),                # no quorum yet
    (14, [ME], None, None),              # this rank never got a quorum: nothing to account for
])
def test_only_a_newer_quorum_that_counts_this_process_is_unseen(previous, members, last, expected):
    assert unseen_quorum(previous, members, ME, last) == expected


def test_shared_ids_round_trip_and_anything_else_is_refused():
    assert decode_ids(encode_ids([14, 15])) == [14, 15] and decode_ids(b"") == []
    for bad in (b"14 x", b"-3", b"1.5", b" ".join([b"1"] * (MAX_SHARED + 1)), b"9" * 500):
        with pytest.raises(ValueError):
            decode_ids(bad)


def _certified_at_13() -> QuorumHistory:
    h = QuorumHistory(gap_wait_s=30.0)
    h.close(None, (13, (ME, PEER)))
    h.agreed(Agreement(True, True, False, "", continuous=True), OK_ROWS, 0)
    h.decided(committed=True, group_agreed=True, nobody_commits=False, group_met=True)
    return h


def _continuity_after(h: QuorumHistory, new_id: int):
    """The continuity verdict of quorum ``new_id`` with this group and a restarted peer (no history)."""
    h.close((13, (ME, PEER)), (new_id, (ME, PEER_AGAIN)))
    return continuous(new_id, [(h.certified, h.dead_ends(), h.certified_committers), (-1, (), 0)], h.missed)


def test_a_quorum_read_after_a_timed_out_try_closes_the_gap_the_restarted_peer_cannot():
    h = _certified_at_13()
    u = UnseenQuorums("lh", h, "[replica 0 rank 0]", me=lambda: ME, fetch=lambda a, t: _status(14, ME))
    assert u.look(13, 13) == 14 and u.found == [14]
    assert _continuity_after(h, 15) is None
    # Without the read, quorum 14 is a gap no member of quorum 15 can account for (what the user saw).
    assert _continuity_after(_certified_at_13(), 15) == 14


def test_a_failed_read_or_an_unknown_replica_id_records_nothing():
    h = _certified_at_13()

    def down(address, timeout_s):
        raise OSError("connection refused")

    u = UnseenQuorums("lh", h, "w", me=lambda: ME, fetch=down)
    assert u.look(13, 13) is None and u.failed_reads == 1
    u = UnseenQuorums("lh", h, "w", me=lambda: ME, fetch=lambda a, t: (_ for _ in ()).throw(StatusFormatError("x")))
    assert u.look(13, 13) is None and u.failed_reads == 1
    reads = []

    def no_id():
        raise KeyError("replica_id")

    u = UnseenQuorums("lh", h, "w", me=no_id, fetch=lambda a, t: reads.append(a) or _status(14, ME))
    assert u.look(13, 13) is None and reads == [] and not h.dead


def test_an_id_the_lighthouse_issues_again_to_a_call_the_group_acts_on_is_no_dead_end():
    """torchft's lighthouse keeps the id while the membership holds and nobody reports failed commits: the next
    answer can carry the id a timed-out try was issued. Acted on, it is classified like any other quorum."""
    h = _certified_at_13()
    UnseenQuorums("lh", h, "w", me=lambda: ME, fetch=lambda a, t: _status(14, ME)).look(13, 13)
    h.close((13, (ME, PEER)), (14, (ME,)))
    assert 14 not in h.dead


def test_rank_0_shares_what_it_found_and_the_other_ranks_record_it():
    store = Store()
    h0, h1 = _certified_at_13(), _certified_at_13()
    u0 = UnseenQuorums("lh", h0, "r0", me=lambda: ME, fetch=lambda a, t: _status(14, ME))
    u1 = UnseenQuorums("lh", h1, "r1", me=lambda: ME, fetch=lambda a, t: _status(None))
    u0.look(13, 13)
    u0.share(store, "k")
    assert u0.found == [] and u1.adopt(store, "k", 13) == [14] and h1.dead == {14}
    assert u1.adopt(store, "absent", 13) == []
    store.set("bad", b"14 rm -rf")
    assert u1.adopt(store, "bad", 13) == [] and h1.dead == {14}


def _last_quorum_13(r):
    r.remember(Quorum(13, 0, 2), [ME, PEER])
    r.history.agreed(Agreement(True, True, False, "", continuous=True), OK_ROWS, 0)
    r.after_commit(True, False)


def test_the_rider_reads_the_status_after_a_try_times_out_and_shares_it_with_its_group():
    """The user's Ctrl-C, at the rider: the first try ends by torchft's deadline after the lighthouse issued it
    quorum 14; the second is answered with quorum 15. Both ranks of the group count 14 as a dead end."""
    store = Store()
    store.set("replica_id", ME.encode())
    kw = dict(answer=True, size=2, store=store, quorum_timeout=timedelta(seconds=2), tries=2)
    r0, r1 = _rider(rank=0, **kw), _rider(rank=1, **kw)
    reads = []
    r0.unseen._fetch = lambda a, t: reads.append(a) or _status(14, ME)
    follower_reads = []
    r1.unseen._fetch = lambda a, t: follower_reads.append(a) or _status(None)  # it takes rank 0's word instead
    for r in (r0, r1):
        _last_quorum_13(r)
    ask_as_a_group_of_two(r0, r1, fail=1, quorum_id=15)
    assert len(reads) == 2 and follower_reads == []  # right after the timeout and right before the next try
    for r in (r0, r1):
        r.remember(Quorum(15, 0, 2), [ME, PEER_AGAIN])
        assert r.history.dead == {14} and r.history.certified == 13


def test_the_rider_reads_nothing_while_its_tries_are_answered():
    store = Store()
    store.set("replica_id", ME.encode())
    r = _rider(answer=True, store=store, quorum_timeout=timedelta(seconds=2), tries=2)
    reads = []
    r.unseen._fetch = lambda a, t: reads.append(a) or _status(14, ME)
    _last_quorum_13(r)
    assert r.quorum(Tries(fail=0, answer=Quorum(14, 0, 1))).quorum_id == 14 and reads == []
