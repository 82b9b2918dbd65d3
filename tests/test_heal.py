"""The ranks of a replica group apply a heal together or not at all: HealAgreement's state, the group's one
in-group exchange and decision (2 real gloo ranks); what a restarted group with no peer does."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from ftbridge.device import exchange_in_group
from ftbridge.manager import HealAgreement
from ftbridge.manager.commit import Flags, decide_group, encode_flags

pytestmark = pytest.mark.timeout(120)


class FakeTorchft:
    """The torchft Manager attributes HealAgreement reads, after a quorum that heals (or not)."""

    def __init__(self, healing, received):
        self._healing = healing
        self._step, self._batches_committed = 3, 12
        self._pending_state_dict = None
        self._error = None if received or not healing else RuntimeError("recv failed")
        self.agreement = HealAgreement(self)
        if healing and received:  # what torchft's quorum thread does after a successful fetch
            self._pending_state_dict = {"user": {}, "torchft": {"step": 40, "batches_committed": 160}}
            self.load_state_dict(self._pending_state_dict["torchft"])
            self._step = 40

    def state_dict(self):
        return {"step": self._step, "batches_committed": self._batches_committed}

    def load_state_dict(self, state):
        self._step, self._batches_committed = state["step"], state["batches_committed"]

    def wait_quorum(self):
        pass

    def errored(self):
        return self._error

    def report_error(self, e):
        self._error = e


def _rank(rank, store_path, cases, out_dir):
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        results = []
        for healing, received in cases[rank]:
            m = FakeTorchft(healing, received)
            healing_now, ready = m.agreement.state()
            flags = Flags(step=m._step, errored=m.errored() is not None, agreement=True, healing=healing_now,
                          heal_ready=ready)
            decision = decide_group(exchange_in_group(encode_flags(flags), 2))
            m.agreement.settle(drop=decision.drop_heal)
            ok = not decision.drop_heal
            results.append(f"{int(ok)}{int(m._pending_state_dict is not None)}{int(m.errored() is not None)}"
                           f"-{m._step}-{m._batches_committed}")
        with open(os.path.join(out_dir, f"r{rank}"), "w") as f:
            f.write(",".join(results))
    finally:
        dist.destroy_process_group()


def test_one_rank_failing_to_receive_drops_the_heal_on_every_rank(tmp_path):
    cases = {
        0: [(False, False), (True, True), (True, True)],
        1: [(False, False), (True, True), (True, False)],
    }
    mp.start_processes(_rank, args=(str(tmp_path / "store"), cases, str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    r0 = (tmp_path / "r0").read_text().split(",")
    r1 = (tmp_path / "r1").read_text().split(",")
    # (ok, still holds a pending state, error recorded) - torchft step - batches committed
    assert r0[0] == r1[0] == "100-3-12"      # no heal this step: nothing to agree on
    assert r0[1] == r1[1] == "110-40-160"    # both received: both apply, at the donor's step
    # Rank 0 received but rank 1 did not: rank 0 drops its state and takes back torchft's counters too.
    assert r0[2] == "001-3-12"
    assert r1[2] == "001-3-12"


def test_a_restarted_group_with_nothing_waits_for_a_peer_then_stops_instead_of_training_alone():
    from ftbridge.heal import restart_without_peer

    base = dict(restarted_empty=True, all_members_empty=True, waited_s=5.0, limit_s=30.0)
    assert restart_without_peer(**base) == "wait"
    assert restart_without_peer(**{**base, "waited_s": 31.0}) == "stop"          # the others finished or died
    assert restart_without_peer(**{**base, "restarted_empty": False}) == "go"     # a first launch, or resumed
    assert restart_without_peer(**{**base, "all_members_empty": False}) == "go"   # a member holds the state: heal
    assert restart_without_peer(**{**base, "limit_s": 0.0}) == "go"               # disabled


def test_a_step_discarded_on_purpose_keeps_its_heal_but_a_real_error_drops_it():
    from ftbridge.manager.heal_agreement import DiscardStep

    kept = FakeTorchft(healing=True, received=True)
    kept.report_error(DiscardStep("slots: a member heals in this step"))
    assert kept.agreement.state() == (True, True)
    dropped = FakeTorchft(healing=True, received=True)
    dropped.report_error(RuntimeError("the cross-replica all-reduce failed"))
    assert dropped.agreement.state() == (True, False)
