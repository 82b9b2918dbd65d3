"""Collateral deaths and silent ranks: the chaos run's checks on who died and who lived on without committing."""

from __future__ import annotations

import time

from ftbridge.harness.chaos import deaths
from ftbridge.harness.chaos import invariants as inv

T0 = time.mktime((2026, 12, 3, 7, 5, 0, 0, 0, -1))
"""07:05:00 local time on 2026-12-03, the clock the sample log below is written in."""


def _torchrun_failed(hh_mm_ss: str, pid: int, code: int = -9) -> str:
    return (f"E1203 {hh_mm_ss}.583000 2519 .venv/lib/python3.11/site-packages/torch/distributed/elastic/"
            f"multiprocessing/api.py:1002] failed (exitcode: {code}) local_rank: 0 (pid: {pid}) of binary: python")


LOG = "\n".join([
    "2026-12-03 07:04:56 INFO [replica group 1 launcher] running: env TORCH_ELASTIC_SHUTDOWN_TIMEOUT=10 ...",
    "2026-12-03 07:05:09 INFO [replica 1 rank 0 step 9] committed loss=2.1",
    _torchrun_failed("07:05:10", 100),
    "2026-12-03 07:05:19 INFO [replica 1 rank 0 step 19] committed loss=2.0",
    "2026-12-03 07:05:20 ERROR [replica 1 rank 0 step 20] quorum failed: TimeoutError: Timeout expired",
    _torchrun_failed("07:05:21", 200, code=1),
])


def _start(pid: int, group: int, t: float, rank: int = 0):
    return {"event": "start", "pid": pid, "replica_group": group, "group_rank": rank, "time": t}


def _step(pid: int, t: float, committed: bool = True, group: int = 1):
    return {"pid": pid, "replica_group": group, "group_rank": 0, "time": t, "step": int(t), "committed": committed}


def test_deaths_are_read_from_torchruns_lines_with_time_code_and_the_launchs_own_cause():
    found = deaths.deaths_in_log(LOG, 2026)
    assert [(d.pid, d.exitcode) for d in found] == [(100, -9), (200, 1)]
    assert abs(found[0].time - (T0 + 10.583)) < 1e-6 and abs(found[1].time - (T0 + 21.583)) < 1e-6
    # The first launch was killed with nothing telling in its lines (the launcher's env line is not a cause);
    # the second names its own error, not the first launch's.
    assert deaths.signature(LOG, found[0]) == "exitcode -9: (no error line before it)"
    second = deaths.signature(LOG, found[1])
    assert second.startswith("exitcode 1: ") and "TimeoutError: Timeout expired" in second


def test_a_death_is_collateral_unless_it_falls_in_a_failure_aimed_at_its_group():
    events = [_start(100, 1, T0), _start(200, 1, T0 + 11)]
    found = deaths.deaths_in_log(LOG, 2026)
    # One failure that killed the launch and, in its heal, the restart (a joiner killed mid-heal).
    one = [(T0 + 9.5, T0 + 30, [1])]
    assert deaths.collateral(found, events, one) == []
    # A failure at the other group explains nothing; one at this group that was over before the death neither.
    missed = [(T0 + 9.5, T0 + 12, [1]), (T0 + 20.5, T0 + 25, [0])]
    assert [(d.pid, g, r) for d, g, r in deaths.collateral(found, events, missed)] == [(200, 1, 0)]
    lines = deaths.collateral_in_logs({"group_1.log": LOG}, events, missed, year=2026)
    assert len(lines) == 1 and "replica group 1 rank 0 (pid 200)" in lines[0] and "exitcode 1" in lines[0]
    # Deaths from the run's own stop on are not judged (stand-by launches are ended then).
    assert deaths.collateral(found, events, missed, until=T0 + 21) == []
    # A process that never wrote a start record (it died starting) is not judged.
    assert deaths.collateral(found, [_start(200, 1, T0 + 11)], []) == [(found[1], 1, 0)]


def test_a_death_while_another_process_held_the_same_group_rank_is_a_displacement_not_collateral():
    found = deaths.deaths_in_log(LOG, 2026)  # pid 100 dies at T0 + 10.6, pid 200 at T0 + 21.6
    spare = [_start(300, 1, T0 + 5), _step(300, T0 + 25)]  # a spare took group 1 at T0 + 5 and lived on
    events = [_start(100, 1, T0), _start(200, 1, T0 + 11), *spare]
    assert deaths.collateral(found, events, []) == []
    # Not when the other holder was already gone (its last record before the death) ...
    gone = [_start(100, 1, T0), _start(200, 1, T0 + 11), _start(300, 1, T0 + 5), _step(300, T0 + 10)]
    assert [d.pid for d, _, _ in deaths.collateral(found, gone, [])] == [100, 200]
    # ... nor a plain restart (it starts after the death), nor a holder of another rank or group.
    others = [_start(100, 1, T0), _start(200, 1, T0 + 11), _start(301, 1, T0 + 5, rank=1), _step(301, T0 + 25),
              _start(302, 0, T0 + 5), _step(302, T0 + 25)]
    assert [d.pid for d, _, _ in deaths.collateral(found, others, [])] == [100, 200]


def test_a_rank_silent_past_the_bound_while_alive_is_caught_whether_it_died_or_lived_on():
    steady = [_step(1, T0 + i) for i in range(10)]
    assert inv.silent_ranks(steady, {}, bound_s=5) == []
    # Commits, then 30 s of discarded steps before it ends (the wedge: alive, committing nothing).
    wedged = steady + [_step(1, T0 + 10 + i, committed=False) for i in range(30)]
    found = inv.silent_ranks(wedged, {}, bound_s=5)
    assert len(found) == 1 and "replica group 1 rank 0 (pid 1) went 30.0 s without a commit" in found[0].detail
    # The same silence ended by its death: measured to the death, within the bound when it died early.
    assert inv.silent_ranks(steady, {1: T0 + 12}, bound_s=5) == []
    assert len(inv.silent_ranks(steady, {1: T0 + 20}, bound_s=5)) == 1
    # A gap between two commits counts too; a process that never committed (a spare) is not judged.
    gap = [_step(1, T0), _step(1, T0 + 9), _step(2, T0 + 100, committed=False)]
    assert [v.detail.split(" went ")[0] for v in inv.silent_ranks(gap, {}, bound_s=5)] == [
        "replica group 1 rank 0 (pid 1)"]
    # A pause its group announced (it stood aside, cut off from its peers) is its own bounded outcome.
    aside = steady + [{"event": "stand_aside", "time": T0 + 10, "seconds": 30.0, "pid": 1, "step": 10},
                      _step(1, T0 + 41)]
    assert inv.silent_ranks(aside, {}, bound_s=5) == []
    assert len(inv.silent_ranks(aside + [_step(1, T0 + 60)], {}, bound_s=5)) == 1, "silent after its pause ended"


def _rec(rank: int, step: int, committed: bool, quorum: int = 3, group: int = 0):
    return {"replica_group": group, "group_rank": rank, "pid": 10 + rank, "time": float(step) + rank / 10,
            "step": step, "quorum_id": quorum, "committed": committed}


def test_the_ranks_of_a_group_take_the_same_decision_on_every_attempt_they_both_recorded():
    # Both ranks: step 5 discarded, retried and committed in the same quorum; rank 1 died before its last record.
    agree = [_rec(0, 5, False), _rec(1, 5, False), _rec(0, 6, True), _rec(1, 6, True), _rec(0, 7, True)]
    compared, found = inv.group_ranks_agree(agree)
    assert (compared, found) == (1, [])
    # Rank 1 discarded the attempt its group-mate committed: a split inside the group.
    split = [_rec(0, 5, False), _rec(1, 5, False), _rec(0, 6, True), _rec(1, 5, False)]
    compared, found = inv.group_ranks_agree(split)
    assert [v.detail for v in found] == ["replica group 0 quorum 3 step 5: committed on ranks [0], discarded on "
                                         "ranks [1]"]
    assert "ranks of a group agree" in [c.name for c in inv.log_checks(split) if not c.held]
