"""What ftbridge/manager/unseen.py relies on, against torchft's real lighthouse and manager servers (no training):
a quorum request whose try timed out stays in the lighthouse's table and is issued the next quorum; that quorum
shows on the status page with this group's replica id; a failed commit makes the next answer a new id. Then
:class:`UnseenQuorums` reads it and the continuity gap the user hit after a Ctrl-C is closed."""

from __future__ import annotations

import concurrent.futures
import time
from datetime import timedelta

import pytest
from torchft._torchft import ManagerClient, ManagerServer

from ftbridge.manager.commit import ROW, ROW_OK, Agreement, continuous
from ftbridge.manager.history import QuorumHistory
from ftbridge.manager.lighthouse_status import fetch_status
from ftbridge.manager.torchft_api import LighthouseServer
from ftbridge.manager.unseen import UnseenQuorums

pytestmark = pytest.mark.timeout(60)

HEARTBEAT_TIMEOUT_MS = 1500


def _server(replica_id: str, lighthouse: str) -> ManagerServer:
    return ManagerServer(replica_id=replica_id, lighthouse_addr=lighthouse, hostname="127.0.0.1", bind="127.0.0.1:0",
                         store_addr="127.0.0.1:1", world_size=1, heartbeat_interval=timedelta(milliseconds=100),
                         connect_timeout=timedelta(seconds=5), quorum_retries=0)


def _ask(client: ManagerClient, step: int, timeout_s: float, commit_failures: int = 0):
    return client._quorum(group_rank=0, step=step, checkpoint_metadata="", shrink_only=False,
                          timeout=timedelta(seconds=timeout_s), init_sync=True, commit_failures=commit_failures)


def test_a_quorum_issued_to_a_timed_out_try_is_read_back_and_closes_the_gap():
    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100, quorum_tick_ms=50,
                          heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
    me, peer = "replica_group_0:a", "replica_group_1:b"
    a, b = _server(me, lh.address()), _server(peer, lh.address())
    ca = ManagerClient(a.address(), connect_timeout=timedelta(seconds=5))
    cb = ManagerClient(b.address(), connect_timeout=timedelta(seconds=5))
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = [f.result() for f in [pool.submit(_ask, ca, 5, 10.0), pool.submit(_ask, cb, 5, 10.0)]]
        assert {q.quorum_id for q in first} == {1}

        b.shutdown()  # group 1 stops (a Ctrl-C): its heartbeats end, the lighthouse still counts it for a while
        with pytest.raises(TimeoutError):  # with two groups, group 0's quorum waits out group 1's heartbeat
            _ask(ca, 5, 0.3)
        deadline = time.monotonic() + 10 * HEARTBEAT_TIMEOUT_MS / 1000
        status = fetch_status(lh.address(), timeout_s=2.0)
        while status.previous_quorum_id == 1 and time.monotonic() < deadline:
            time.sleep(0.05)  # polling the lighthouse's own state: the quorum forms at its heartbeat timeout
            status = fetch_status(lh.address(), timeout_s=2.0)
        # The lighthouse issued a quorum to the request whose try had timed out: nobody got its answer.
        assert status.previous_quorum_id == 2 and [m.replica_id for m in status.members] == [me]

        history = QuorumHistory(gap_wait_s=30.0)
        history.close(None, (1, (me, peer)))
        ok = [[1.0 if i == ROW_OK else 0.0 for i in range(ROW)]] * 2
        history.agreed(Agreement(True, True, False, "", continuous=True), ok, 0)
        history.decided(committed=True, group_agreed=True, nobody_commits=False, group_met=True)
        unseen = UnseenQuorums(lh.address(), history, "[replica 0 rank 0]", me=lambda: me)
        assert unseen.look(last_id=1, current=1) == 2

        # Its next try reports the step it failed to commit: the lighthouse gives the same members a new id.
        nxt = _ask(ca, 5, 10.0, commit_failures=1)
        assert nxt.quorum_id == 3 and list(nxt.replica_ids) == [me]
        restarted = "replica_group_1:c"  # group 1 started again: no history of quorums
        history.close((1, (me, peer)), (3, (me, restarted)))
        assert continuous(3, [(history.certified, history.dead_ends(), history.certified_committers),
                              (-1, (), 0)], history.missed) is None
        assert continuous(3, [(1, (), 2), (-1, (), 0)]) == 2  # without the read: the gap that stopped the job
    finally:
        a.shutdown()
        lh.shutdown()
