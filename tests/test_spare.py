"""Unit tests of the warm spare's decisions (ftbridge.spare): when to join, which group it replaces."""

from types import SimpleNamespace

import pytest

from ftbridge import spare
from ftbridge.config import FTBridgeConfig
from ftbridge.manager.lighthouse_status import Heartbeat


def hb(group, stale=False, uid="u", age=None):
    return Heartbeat(f"replica_group_{group}:{uid}", (5.0 if stale else 0.1) if age is None else age, stale)


def test_vacant_is_a_known_group_whose_every_heartbeat_is_stale():
    fresh, known = spare.heartbeat_groups([hb(0), hb(1, stale=True), hb(2, uid="old", stale=True), hb(2, uid="new"),
                                           Heartbeat("someone_else", 0.1, True)])
    assert (fresh, known) == ({0, 2}, {0, 1, 2})
    assert spare.vacancies(fresh, known, 3) == [1]


def test_never_heard_of_is_not_vacant_so_a_spare_started_first_waits_for_the_job():
    assert spare.vacancies({0}, {0}, 2) == []


def test_nothing_is_vacant_without_a_live_group_to_heal_from():
    assert spare.vacancies(set(), {0, 1}, 2) == []


def test_groups_outside_the_plan_are_ignored():
    assert spare.vacancies({0}, {0, 5}, 2) == []


def test_groups_that_lost_the_lighthouse_together_leave_nothing_vacant():
    # Chaos seed 50: every group cut off from the lighthouse; the read in which groups 0 and 1 turned stale
    # (2.04 s, 2.01 s against a 2 s timeout) showed group 2 fresh at 1.99 s, and the spare took id 0.
    w = spare.VacancyWatch(num_groups=3, spare_index=0, job_gone_s=30)
    outage = [hb(0, stale=True, age=2.04), hb(1, stale=True, age=2.01), hb(2, age=1.99)]
    assert spare.live_groups(outage) == set()
    assert w.observe(10.0, outage) == ("wait", None)
    death = [hb(0, stale=True, age=2.04), hb(1, age=0.05), hb(2, age=0.09)]  # group 0 died, 1 and 2 live
    assert spare.live_groups(death) == {1, 2}
    assert w.observe(10.1, death) == ("wait", None)
    assert w.observe(10.1 + spare.VACANT_FOR_S, death) == ("join", 0)


def test_spare_k_waits_the_vacancy_time_and_k_stagger_periods_then_takes_the_smallest_vacancy():
    first = {1: 10.0, 3: 10.5}
    assert spare.choose_group([3, 1], first, 11.9, spare_index=0, vacant_for_s=2.0) is None
    assert spare.choose_group([3, 1], first, 12.0, spare_index=0, vacant_for_s=2.0) == 1
    assert spare.choose_group([3, 1], first, 12.9, spare_index=1, stagger_s=1.0, vacant_for_s=2.0) is None
    assert spare.choose_group([3, 1], first, 13.0, spare_index=1, stagger_s=1.0, vacant_for_s=2.0) == 1
    assert spare.choose_group([], {}, 99.0, spare_index=0) is None


def test_a_live_group_whose_heartbeat_was_only_late_is_not_taken():
    # Chaos seed 60: a restarting launch starved a live group's heartbeat thread for 2.01 s (against a 2 s
    # timeout); spare 0 took its id at once and the job held two copies of that group for a minute.
    w = spare.VacancyWatch(num_groups=3, spare_index=0, job_gone_s=30)
    late = [hb(0, age=0.08), hb(1, age=0.02), hb(2, stale=True, age=2.01)]
    assert w.observe(10.0, late) == ("wait", None)
    assert w.observe(10.5, [hb(0), hb(1), hb(2)]) == ("wait", None)  # its heartbeat came: no longer vacant
    assert w.first_seen == {}
    assert w.observe(11.0, late) == ("wait", None)
    assert w.observe(12.9, late) == ("wait", None), "the vacancy counts from when it was seen again"
    assert w.observe(13.0, late) == ("join", 2)


def test_watch_joins_when_the_lighthouse_drops_a_group_and_not_before():
    w = spare.VacancyWatch(num_groups=2, spare_index=0, job_gone_s=30)
    assert w.observe(0.0, None) == ("wait", None)                      # status read failed
    assert w.observe(0.1, [hb(0)]) == ("wait", None)                    # group 1 not up yet
    assert w.observe(1.0, [hb(0), hb(1)]) == ("wait", None)             # full strength
    assert w.observe(2.0, [hb(0), hb(1, stale=True)]) == ("wait", None)  # dropped: vacant from now
    assert w.observe(2.0 + spare.VACANT_FOR_S, [hb(0), hb(1, stale=True)]) == ("join", 1)


def test_second_spare_leaves_a_vacancy_to_the_first_one_that_fills_it():
    w = spare.VacancyWatch(num_groups=2, spare_index=1, job_gone_s=30)
    assert w.observe(2.0, [hb(0), hb(1, stale=True)]) == ("wait", None)
    # spare 0 took group 1 within the stagger period: no vacancy left, the vacancy memory is dropped
    assert w.observe(2.5, [hb(0), hb(1, stale=True), hb(1, uid="spare0")]) == ("wait", None)
    assert w.first_seen == {}
    assert w.observe(3.5, [hb(0), hb(1, stale=True), hb(1, uid="spare0")]) == ("wait", None)


def test_watch_exits_once_no_group_has_been_live_for_job_gone_s():
    w = spare.VacancyWatch(num_groups=2, spare_index=0, job_gone_s=5)
    assert w.observe(0.0, [hb(0), hb(1)]) == ("wait", None)
    assert w.observe(4.0, [hb(0, stale=True), hb(1, stale=True)]) == ("wait", None)
    assert w.observe(5.0, [hb(0, stale=True), hb(1, stale=True)]) == ("exit", None)


def test_watch_exits_when_the_lighthouse_stops_answering_after_the_job_ran():
    """A launcher that stood by as a spare outlived its job: the job ended, its lighthouse was stopped, and the
    spare waited for it for good."""
    w = spare.VacancyWatch(num_groups=2, spare_index=0, job_gone_s=5)
    assert w.observe(0.0, [hb(0), hb(1)]) == ("wait", None)
    assert w.observe(4.0, None) == ("wait", None)
    assert w.observe(5.0, None) == ("exit", None)
    never = spare.VacancyWatch(num_groups=2, spare_index=0, job_gone_s=5)
    assert never.observe(100.0, None) == ("wait", None)  # started before its lighthouse: it waits


def test_watch_never_exits_before_it_saw_a_live_group():
    w = spare.VacancyWatch(num_groups=2, spare_index=0, job_gone_s=0)
    assert w.observe(100.0, []) == ("wait", None)


class FakeStore:
    def __init__(self):
        self.data = {}
        self.checks = 0

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def check(self, keys):
        self.checks += 1
        if self.checks == 3:  # rank 0 decides while the other rank polls
            self.set(spare.STORE_KEY, "1")
        return all(k in self.data for k in keys)

    def get(self, key):
        return self.data[key]


def test_other_ranks_take_rank_0s_decision_from_the_group_store():
    store = FakeStore()
    assert spare.share_decision(store, 1, sleep=lambda s: None) == 1
    rank0 = FakeStore()
    assert spare.share_decision(rank0, 0, None) is None
    assert rank0.data[spare.STORE_KEY] == b"-1"
    assert spare.share_decision(rank0, 2, sleep=lambda s: None) is None


def _cfg(**kw):
    return FTBridgeConfig.resolve(environ={}, num_replica_groups=2, **kw)


def test_stand_by_takes_over_the_dead_groups_id_and_so_its_data_shard(monkeypatch):
    import itertools

    from ftbridge.harness.lm_job import topology

    monkeypatch.setattr(spare, "VACANT_FOR_S", 0.05)
    reads = itertools.chain([[hb(0), hb(1)], [hb(0), hb(1)]], itertools.repeat([hb(0), hb(1, stale=True)]))
    fetch = lambda address, timeout_s: SimpleNamespace(heartbeats=next(reads))  # noqa: E731
    cfg = _cfg(spare_index=0, replica_group_id=2)
    takeover = spare.stand_by(cfg, fetch=fetch)
    assert takeover.cfg.replica_group_id == 1
    assert takeover.event()["replaces"] == 1 and takeover.event()["event"] == "spare_join"
    cold = _cfg(replica_group_id=1)  # what a cold restart of group 1 resolves
    assert topology(takeover.cfg) == topology(cold)


def test_stand_by_exits_0_when_the_job_is_over(monkeypatch):
    monkeypatch.setattr(spare, "POLL_S", 0.0)
    reads = iter([[hb(0), hb(1)]] + [[hb(0, stale=True), hb(1, stale=True)]] * 1000)
    fetch = lambda address, timeout_s: SimpleNamespace(heartbeats=next(reads))  # noqa: E731
    with pytest.raises(SystemExit) as exc:
        spare.stand_by(_cfg(spare_index=0, restart_peer_wait=0.001), fetch=fetch)
    assert exc.value.code == 0


def test_a_restarted_launch_that_never_sees_a_live_group_exits_after_the_bound():
    """Found by a chaos soak with spares: a spare's launch restarted after the job ended never saw a live
    group, so its job-over bound never started and it stood by until it was killed. (A first launch still
    waits for a live group: test_watch_never_exits_before_it_saw_a_live_group.)"""
    now = iter(range(1000))
    group, _ = spare.watch_lighthouse(_cfg(spare_index=0, restart_peer_wait=5), restarted=True,
                                      fetch=lambda address, timeout_s: SimpleNamespace(heartbeats=[]),
                                      clock=lambda: float(next(now)), sleep=lambda s: None)
    assert group is None


def test_stand_by_refuses_an_active_group():
    with pytest.raises(ValueError, match="spare_index=-1"):
        spare.stand_by(_cfg())


def test_config_rejects_a_bad_spare_index():
    with pytest.raises(ValueError, match="spare_index=-2"):
        _cfg(spare_index=-2)


def test_config_rejects_a_spare_of_a_one_group_job():
    with pytest.raises(ValueError, match="plan at least 2 groups"):
        FTBridgeConfig.resolve(environ={}, num_replica_groups=1, spare_index=0)


def hb_age(group, age, stale=False, uid="u"):
    return Heartbeat(f"replica_group_{group}:{uid}", age, stale)


def test_a_restarted_group_is_held_by_another_only_if_a_heartbeat_is_younger_than_its_own_start():
    # its dead predecessor's last heartbeat is older than this process (even while not yet stale)
    assert not spare.held_by_another([hb_age(1, 3.0, uid="pred"), hb_age(0, 0.05)], 1, since_s=2.5)
    # a spare heartbeating as group 1 right now
    assert spare.held_by_another([hb_age(1, 3.0, stale=True, uid="pred"), hb_age(1, 0.05, uid="spare")], 1, 2.5)
    assert not spare.held_by_another([hb_age(1, 0.05, stale=True)], 1, 2.5)


def test_restarted_group_whose_id_a_spare_holds_stands_by_as_a_spare():
    beats = [hb_age(0, 0.05), hb_age(1, 0.05, uid="spare")]
    fetch = lambda address, timeout_s: SimpleNamespace(heartbeats=beats)  # noqa: E731
    cfg = _cfg(replica_group_id=1)
    demoted = spare.demote_if_taken(cfg, restart_count=1, imported_at=0.0, fetch=fetch)
    assert demoted.spare_index == 3 and demoted.replica_group_id == 5  # index N + G; stand-by id N + index
    # first launch, or nobody else holds the id: unchanged
    assert spare.demote_if_taken(cfg, restart_count=0, imported_at=0.0, fetch=fetch) is cfg
    alone = lambda address, timeout_s: SimpleNamespace(heartbeats=beats[:1])  # noqa: E731
    assert spare.demote_if_taken(cfg, restart_count=1, imported_at=0.0, fetch=alone) is cfg


class _Clock:
    """A fake monotonic clock that ``sleep`` moves."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, s):
        self.now += s


def test_a_lighthouse_that_never_answers_never_demotes_and_is_waited_for_at_most_the_quorum_timeout():
    clock = _Clock()

    def down(address, timeout_s):
        clock.now += 0.5
        raise OSError("connection refused")

    cfg = _cfg(replica_group_id=1)
    assert spare.demote_if_taken(cfg, restart_count=2, imported_at=0.0, fetch=down, clock=clock,
                                 sleep=clock.sleep) is cfg
    assert cfg.quorum_timeout.total_seconds() <= clock.now <= cfg.quorum_timeout.total_seconds() + 1


def test_a_lighthouse_that_answers_at_once_is_read_once():
    reads = []
    beats = [hb_age(0, 0.05), hb_age(1, 0.05, uid="spare")]
    fetch = lambda address, timeout_s: reads.append(1) or SimpleNamespace(heartbeats=beats)  # noqa: E731
    demoted = spare.demote_if_taken(_cfg(replica_group_id=1), restart_count=1, imported_at=0.0, fetch=fetch)
    assert demoted.spare_index == 3
    assert len(reads) == 1


def test_a_restart_while_the_lighthouse_is_hung_waits_for_its_answer_and_stands_by_if_its_id_is_taken():
    """A restart that read the lighthouse once while it was hung joined as a second copy of its group
    (chaos seed 71): every member then lost quorums to rendezvous timeouts until one copy left."""
    clock, reads = _Clock(), []
    resumed = [hb_age(0, 0.05), hb_age(1, 4.0, stale=True, uid="spare")]  # its heartbeats not in yet
    beats = [hb_age(0, 0.05), hb_age(1, 0.05, uid="spare")]

    def hung_then_answers(address, timeout_s):
        reads.append(clock.now)
        clock.now += timeout_s if len(reads) <= 3 else 0.01  # three reads time out, as on a stopped lighthouse
        if len(reads) <= 3:
            raise OSError("timed out")
        return SimpleNamespace(heartbeats=resumed if len(reads) == 4 else beats)

    demoted = spare.demote_if_taken(_cfg(replica_group_id=1), restart_count=1, imported_at=0.0,
                                    fetch=hung_then_answers, clock=clock, sleep=clock.sleep)
    assert demoted.spare_index == 3 and len(reads) > 4


def test_only_the_healing_holder_of_a_duplicated_group_id_leaves():
    ids = ["replica_group_0:a", "replica_group_1:spare", "replica_group_1:paused"]
    assert spare.must_leave(ids, 1, healing=True)
    assert not spare.must_leave(ids, 1, healing=False)          # the up-to-date holder stays
    assert not spare.must_leave(ids, 0, healing=True)           # a plain heal of group 0
    assert not spare.must_leave(["replica_group_0:a", "replica_group_1:b"], 1, healing=True)


def test_manager_raises_on_a_duplicate_before_torchft_heals():
    from ftbridge.manager import ReplicaManager

    fake = SimpleNamespace(cfg=_cfg(replica_group_id=1), transport=SimpleNamespace(expect_donor=lambda d: None))
    result = SimpleNamespace(recover_src_manager_address="http://x", replica_ids=["replica_group_1:a",
                             "replica_group_1:b"], heal=True, quorum_id=7)
    with pytest.raises(spare.DuplicateReplicaGroup, match="quorum 7: another member holds replica group 1"):
        ReplicaManager._on_quorum(fake, result)
    ReplicaManager._on_quorum(fake, SimpleNamespace(**{**vars(result), "heal": False}))


def test_two_holders_of_one_id_where_nobody_heals_keep_only_the_first():
    """Two spares that took one vacancy at once (at step 0 nobody heals): both used to stay, two copies of
    the group training on one data shard."""
    ids = ["replica_group_0:a", "replica_group_1:x", "replica_group_1:y"]
    assert spare.must_leave(ids, 1, healing=False, me="replica_group_1:y", healers=0)
    assert not spare.must_leave(ids, 1, healing=False, me="replica_group_1:x", healers=0)
    # Someone heals: only the healing holder leaves (the other may be the one up to date).
    assert not spare.must_leave(ids, 1, healing=False, me="replica_group_1:y", healers=1)


def test_two_holders_of_one_id_that_both_heal_keep_the_first():
    """Both holders behind the quorum's step (a restart beside a spare that fell behind; chaos seed 47): both
    used to leave, and the group had no holder until torchrun restarted it."""
    ids = ["replica_group_0:a", "replica_group_1:x", "replica_group_1:y"]
    for healers in (None, 2):
        stays = [not spare.must_leave(ids, 1, healing=True, me=me, healers=healers)
                 for me in ("replica_group_1:x", "replica_group_1:y")]
        assert stays == [True, False]


def test_a_holder_that_alone_heals_leaves_even_when_first_by_replica_id():
    """A torchrun restart at step 0 that joined while the lighthouse could not say its id was taken (chaos
    seed 71): first by replica id, it stayed and healed, and the up-to-date holder had to leave one quorum
    later, costing every member a rendezvous timeout."""
    ids = ["replica_group_0:a", "replica_group_1:restart", "replica_group_1:zspare"]
    assert spare.must_leave(ids, 1, healing=True, me="replica_group_1:restart", healers=1)
    assert not spare.must_leave(ids, 1, healing=False, me="replica_group_1:zspare", healers=1)
    from ftbridge.manager import ReplicaManager

    fake = SimpleNamespace(cfg=_cfg(replica_group_id=1), transport=SimpleNamespace(expect_donor=lambda d: None))
    result = SimpleNamespace(recover_src_manager_address="http://x", replica_ids=ids, heal=True, quorum_id=9,
                             replica_rank=1, replica_world_size=3, max_world_size=2)
    with pytest.raises(spare.DuplicateReplicaGroup, match="quorum 9"):
        ReplicaManager._on_quorum(fake, result)


def test_a_vacancy_seen_right_after_the_lighthouse_did_not_answer_must_settle_first():
    """A lighthouse that was hung shows every group stale until their next heartbeats arrive; a spare took
    a live group's id then, joined as a duplicate and cost every group a vote and a cross-replica timeout."""
    w = spare.VacancyWatch(num_groups=2, spare_index=0, job_gone_s=30)
    assert w.observe(0.0, [hb(0), hb(1)]) == ("wait", None)
    assert w.observe(0.1, None) == ("wait", None)                     # the lighthouse does not answer
    assert w.observe(3.0, [hb(0, stale=True), hb(1)]) == ("wait", None)  # answers again: group 0 looks gone
    assert w.observe(3.1, [hb(0), hb(1)]) == ("wait", None)           # its heartbeat arrived: no vacancy
    assert w.observe(3.2, [hb(0, stale=True), hb(1)]) == ("wait", None)
    assert w.observe(5.1, [hb(0, stale=True), hb(1)]) == ("wait", None)
    assert w.observe(5.2, [hb(0, stale=True), hb(1)]) == ("join", 0)  # still gone VACANT_FOR_S later


def test_a_slow_status_read_counts_as_failed():
    clock = iter([0.0, 1.5, 10.0, 10.2])

    def fetch(address, timeout_s):
        return SimpleNamespace(heartbeats=[hb(0)])

    assert spare._read_heartbeats("lh", fetch, clock=lambda: next(clock)) is None
    assert spare._read_heartbeats("lh", fetch, clock=lambda: next(clock)) is not None


# -- a group cut off from the lighthouse that still answers on its own store keeps its id -----------------

def _member(group, store="10.0.0.1:4000"):
    from ftbridge.manager.lighthouse_status import Member

    return Member(f"replica_group_{group}:u", step=7, world_size=2, manager_address="http://m", store_address=store,
                  recovering=False)


def _cut_off_run(answers, members):
    """Group 1 turns stale after the first read; ``answers``: what each probe of its store says in turn."""
    reads = [SimpleNamespace(heartbeats=[hb(0), hb(1)], members=members)]
    reads += [SimpleNamespace(heartbeats=[hb(0), hb(1, stale=True)], members=[_member(0, "10.0.0.2:4000")])] * 2000
    it, ticks, probed = iter(reads), iter(range(100000)), []

    def probe(address):
        probed.append(address)
        return next(answers)

    group, _ = spare.watch_lighthouse(_cfg(spare_index=0), fetch=lambda address, timeout_s: next(it),
                                      clock=lambda: next(ticks) * 0.1, sleep=lambda s: None, probe=probe)
    return group, probed


def test_a_vacant_group_whose_store_answers_keeps_its_id_until_it_stops_answering():
    group, probed = _cut_off_run(iter([True, True, False]), [_member(0, "10.0.0.2:4000"), _member(1)])
    assert group == 1
    assert probed == ["10.0.0.1:4000"] * 3, "probed at each due vacancy, with the address its last quorum gave"


def test_a_vacant_group_the_spare_never_saw_in_a_quorum_is_taken_without_a_probe():
    group, probed = _cut_off_run(iter([]), [])
    assert group == 1 and probed == []


@pytest.mark.timeout(60)
def test_store_answers_tells_a_live_store_from_a_closed_and_a_silent_one():
    import socket
    import time
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    address = f"127.0.0.1:{store.port}"
    assert spare.store_answers(address)
    del store  # its server thread ends with it: connections are refused
    assert not spare.store_answers(address, timeout_s=0.5)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel accepts, nobody answers: a stopped process
    try:
        t0 = time.monotonic()
        assert not spare.store_answers(f"127.0.0.1:{silent.getsockname()[1]}", timeout_s=0.5)
        assert time.monotonic() - t0 < 5.0, "bounded by its timeout, not the store client's own"
    finally:
        silent.close()
