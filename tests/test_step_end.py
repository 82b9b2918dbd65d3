"""The relay of a donor's forward-consumed state at the end of a heal step (ftbridge.manager.step_end), on a
real TCPStore."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import pytest
from torch.distributed import TCPStore

from ftbridge.manager import step_end
from ftbridge.manager.step_end import StepEndRelay


@pytest.fixture
def store():
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    yield server
    del server


def _result(store, *, quorum_id=4, step=9, replica_rank=0, dst=(), src=None):
    return SimpleNamespace(store_address=f"127.0.0.1:{store.port}", quorum_id=quorum_id, max_step=step,
                           replica_rank=replica_rank, recover_dst_replica_ranks=list(dst),
                           recover_src_replica_rank=src, heal=src is not None)


def test_a_donor_writes_and_its_joiner_reads_the_body_of_its_group_rank(store):
    t = timedelta(seconds=5)
    donor0, donor1, joiner1 = StepEndRelay(0, t), StepEndRelay(1, t), StepEndRelay(1, t)
    assert donor0.publish(_result(store, replica_rank=2, dst=[0]), lambda: b"rank 0's")
    assert donor1.publish(_result(store, replica_rank=2, dst=[0]), lambda: b"rank 1's")
    assert joiner1.fetch(_result(store, src=2)) == b"rank 1's"
    assert joiner1.fetch(_result(store, src=1)) is None, "a donor that wrote nothing"
    assert joiner1.fetch(_result(store, step=10, src=2)) is None, "another step's key"


def test_only_donors_write_only_joiners_read_and_the_previous_key_goes(store):
    t = timedelta(seconds=5)
    relay, calls = StepEndRelay(0, t), []
    assert not relay.publish(_result(store), lambda: calls.append(1) or b"x")
    assert calls == [], "a rank that donates nothing encodes nothing"
    assert relay.fetch(_result(store)) is None and relay.fetch(None) is None
    assert relay.publish(_result(store, step=9, dst=[1]), lambda: b"first")
    assert relay.publish(_result(store, step=12, dst=[1]), lambda: b"second")
    assert not store.check([f"{step_end.PREFIX}/4/9/0/0"]), "the donor's previous key is left behind"
    assert store.check([f"{step_end.PREFIX}/4/12/0/0"])


def test_an_oversized_body_or_a_dead_store_falls_back_without_raising(store, monkeypatch, caplog):
    t = timedelta(seconds=1)
    monkeypatch.setattr(step_end, "MAX_STEP_END_BYTES", 4)
    relay = StepEndRelay(0, t)
    assert not relay.publish(_result(store, dst=[1]), lambda: b"12345")
    assert "over 4" in caplog.text
    assert relay.publish(_result(store, dst=[1]), lambda: b"1234")
    store.set(f"{step_end.PREFIX}/4/9/0/3", b"123456")
    assert relay.fetch(_result(store, src=3)) is None
    dead = SimpleNamespace(**{**vars(_result(store, dst=[1], src=0)), "store_address": "127.0.0.1:1"})
    assert not relay.publish(dead, lambda: b"1")
    assert relay.fetch(dead) is None
    assert "could not be read" in caplog.text and "was not written" in caplog.text
