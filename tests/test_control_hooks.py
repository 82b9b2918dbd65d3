"""The hooks that break the cross-replica average on purpose (ftbridge.harness.control_hooks)."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch
from torch.distributed import ReduceOp

from ftbridge.comm_hooks.base import wait_result
from ftbridge.harness import control_hooks, lm_job


class _Done:
    def wait(self, timeout=None):
        return True


class _Manager:
    def __init__(self, group, step):
        self.cfg = SimpleNamespace(replica_group_id=group)
        self.current_step, self.participants, self.ops = step, 1, []  # alone: its sum is its average

    def allreduce(self, tensor, reduce_op=ReduceOp.AVG):
        self.ops.append(reduce_op)
        return _Done()


def _state(group=0, step=0):
    from ftbridge.comm_hooks.base import CommHookState

    return CommHookState(_Manager(group, step))


def _args(*argv):
    return lm_job.build_parser().parse_args(list(argv))


def test_each_flag_selects_its_hook_and_none_selects_none():
    assert control_hooks.from_args(_args()) is None
    assert control_hooks.from_args(_args("--no-cross-replica-sync")) is control_hooks.no_sync_hook
    assert control_hooks.from_args(_args("--test-sync-sum")) is control_hooks.sum_hook
    assert callable(control_hooks.from_args(_args("--corrupt-sync-at", "1:40")))


def test_two_testing_flags_or_one_with_a_named_hook_are_refused_before_training():
    with pytest.raises(ValueError, match="--no-cross-replica-sync and --test-sync-sum"):
        control_hooks.from_args(_args("--no-cross-replica-sync", "--test-sync-sum"))
    with pytest.raises(ValueError, match="drop --comm-hook"):
        control_hooks.from_args(_args("--test-sync-sum", "--comm-hook", "bf16"))
    with pytest.raises(SystemExit):
        _args("--corrupt-sync-at", "1:0")
    with pytest.raises(argparse.ArgumentTypeError, match="GROUP:STEP"):
        lm_job._group_step("one")


def test_no_sync_keeps_the_gradient_and_sum_asks_for_a_sum():
    t = torch.tensor([1.0, 2.0])
    assert wait_result(control_hooks.no_sync_hook(_state(), t), t) and t.tolist() == [1.0, 2.0]
    state = _state()
    control_hooks.sum_hook(state, t)
    assert state.manager.ops == [ReduceOp.SUM]


def test_the_corrupting_hook_triples_only_its_group_and_step():
    hook = control_hooks.corrupting_hook(group=1, step=5)
    for group, step, want in ((1, 4, 3.0), (1, 5, 1.0), (0, 4, 1.0)):
        t = torch.ones(3)
        assert wait_result(hook(_state(group, step), t), t)
        assert t.tolist() == [want] * 3, (group, step)
