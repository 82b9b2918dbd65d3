"""The division by participants against real torchft: 3 replica groups, one healing, average over the other 2.

Three :class:`ftbridge.manager.ReplicaManager` objects (real torchft Managers,
a real lighthouse, gloo cross-replica groups, ftbridge's heal transport), one
thread each, one rank per group. All three take part in a first step, which
group 2 discards (it reports an error, as a rank whose step failed does) while
groups 0 and 1 commit it; so in the next quorum group 2 is a step behind and
heals from a peer: torchft zeroes its tensors and counts 2 participants. Every path ftbridge averages
through (torchft's AVG for fp32, ftbridge's own divide-then-SUM for fp16/bf16
tensors, the fp16 and bf16 compression hooks) must give every group, the
healing one included, the mean of groups 0 and 1 exactly (the inputs are
chosen so that mean is exact in every dtype).

The unit fakes of ``tests/test_comm_hooks.py`` divide by themselves; this is
the check against torchft's own participant count.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List

import pytest
import torch
from torch.distributed import TCPStore
from torchft.coordination import LighthouseServer

from ftbridge.comm_hooks.base import CommHookState
from ftbridge.comm_hooks.default import allreduce_hook, bf16_compress_hook, fp16_compress_hook
from ftbridge.config import FTBridgeConfig
from ftbridge.manager import ReplicaManager

GROUPS = 3
INPUT = {0: torch.tensor([1.0, 2.0, 4.0, -8.0, 0.5]),
         1: torch.tensor([3.0, 6.0, 12.0, 8.0, 1.5]),
         2: torch.tensor([100.0, 100.0, 100.0, 100.0, 100.0])}  # the healing group's: must count for nothing
MEAN_OF_0_1 = torch.tensor([2.0, 4.0, 8.0, 0.0, 1.0])


def _step(manager: ReplicaManager, g: int, out: Dict[int, Any], fail: bool) -> None:
    """One step: every averaging path on this group's input, then should_commit (after an error if ``fail``)."""
    try:
        manager.start_quorum()
        state = CommHookState(manager)
        x = INPUT[g]
        tensors = {"fp32 AVG (allreduce_hook)": x.clone(), "fp16 divide-then-SUM": x.to(torch.float16),
                   "bf16 divide-then-SUM": x.to(torch.bfloat16), "fp16_compress_hook": x.clone(),
                   "bf16_compress_hook": x.clone()}
        works = [allreduce_hook(state, tensors["fp32 AVG (allreduce_hook)"]),
                 state.allreduce(tensors["fp16 divide-then-SUM"]),
                 state.allreduce(tensors["bf16 divide-then-SUM"]),
                 fp16_compress_hook(state, tensors["fp16_compress_hook"]),
                 bf16_compress_hook(state, tensors["bf16_compress_hook"])]
        for w in works:
            w.wait()
        participating = manager.is_participating()
        if fail:
            manager.report_error(RuntimeError("test: this group's step failed"))
        out[g] = {"participants": state.participants, "participating": participating,
                  "committed": manager.should_commit(), "heals": manager.heals,
                  "tensors": {k: v.float() for k, v in tensors.items()}}
    except BaseException as e:  # noqa: BLE001 - shown by the test, with the group
        out[g] = e


def _run(managers: Dict[int, ReplicaManager], groups: List[int], fail: int = -1, timeout_s: float = 60
         ) -> Dict[int, Any]:
    out: Dict[int, Any] = {}
    threads = [threading.Thread(target=_step, args=(managers[g], g, out, g == fail), daemon=True) for g in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in threads), f"a step did not finish within {timeout_s} s: {out}"
    for g in groups:
        if isinstance(out.get(g), BaseException):
            raise AssertionError(f"replica group {g} failed: {out[g]!r}") from out[g]
    return out


def _manager(g: int, lighthouse: LighthouseServer, monkeypatch) -> ReplicaManager:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    _manager.stores.append(store)  # alive until the test ends
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))  # read once, while the manager is built
    cfg = FTBridgeConfig.resolve({}, lighthouse=lighthouse.address(), group_rank=0, group_size=1,
                                 replica_group_id=g, num_replica_groups=GROUPS, min_replicas=2,
                                 cross_replica_timeout=10)
    w = torch.full((4,), float(g))
    return ReplicaManager(cfg, state_dict=lambda: {"w": w}, load_state_dict=lambda s: w.copy_(s["w"]),
                          max_heal_bytes=lambda: 64 << 20)


_manager.stores = []


@pytest.mark.timeout(120)
def test_a_healing_group_counts_for_nothing_and_the_average_is_over_the_two_participants(monkeypatch):
    for name in ("TORCHFT_TIMEOUT_SEC", "TORCHFT_QUORUM_TIMEOUT_SEC", "TORCHFT_CONNECT_TIMEOUT_SEC",
                 "TORCHFT_QUORUM_RETRIES"):
        monkeypatch.delenv(name, raising=False)  # the managers set them: restored after the test
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=GROUPS)  # every quorum holds all three
    managers: Dict[int, ReplicaManager] = {}
    try:
        managers.update({g: _manager(g, lighthouse, monkeypatch) for g in range(GROUPS)})
        first = _run(managers, list(range(GROUPS)), fail=2)
        assert [first[g]["committed"] for g in range(GROUPS)] == [True, True, False], first
        assert [first[g]["participants"] for g in range(GROUPS)] == [3, 3, 3], first
        out = _run(managers, list(range(GROUPS)))  # group 2 is a step behind: it heals
    finally:
        for m in managers.values():
            m.shutdown()
        lighthouse.shutdown()
        _manager.stores.clear()
    assert [out[g]["participating"] for g in range(GROUPS)] == [True, True, False], out
    assert [out[g]["participants"] for g in range(GROUPS)] == [2, 2, 2]
    assert out[2]["heals"] == 1 and all(out[g]["committed"] for g in range(GROUPS)), out
    for g in range(GROUPS):
        for path, got in out[g]["tensors"].items():
            torch.testing.assert_close(got, MEAN_OF_0_1, atol=0, rtol=0,
                                       msg=lambda m: f"replica group {g}, {path}: {m}")
