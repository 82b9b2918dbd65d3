"""A scripted stand-in for ReplicaManager, for in-process engine tests (no network, no torchft).

One replica group alone: all-reduces leave tensors as they are (the average
over one participant), and ``should_commit`` commits unless the test listed
the call in ``discard_calls`` or an error was reported this step.
"""

from __future__ import annotations

from torch.distributed import ReduceOp


class Done:
    """A finished all-reduce work."""

    def wait(self, timeout=None):
        return True


class FakeManager:
    """Stand-in for :class:`ftbridge.manager.ReplicaManager` (same constructor and per-step calls)."""

    torchft = None  # no torchft Manager underneath: nothing heals
    participants = 1
    replica_rank = 0
    quorum_id = 1
    healed_this_step = False
    heals = 0

    def __init__(self, cfg, *, state_dict, load_state_dict, use_cuda=False, max_heal_bytes=None):
        self.state_dict, self.load_state_dict_fn = state_dict, load_state_dict
        self.discard_calls, self.calls, self.step, self.errors = set(), 0, 0, []
        self.ops = []  # (numel, dtype, reduce_op) per all-reduce

    current_step = property(lambda self: self.step)

    def start_quorum(self):
        pass

    def allreduce(self, tensor, reduce_op=ReduceOp.AVG):
        self.ops.append((tensor.numel(), tensor.dtype, reduce_op))
        return Done()

    def report_error(self, e):
        self.errors.append(e)

    def should_commit(self):
        self.calls += 1
        ok = self.calls not in self.discard_calls and not self.errors
        self.step += ok
        self.errors = []
        return ok

    def shutdown(self):
        pass
