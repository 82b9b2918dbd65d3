"""Communication hooks that break the cross-replica average on purpose: negative controls and the guard's demo.

Each is an ordinary ftbridge communication hook (``hook(state, tensor) -> work``,
:mod:`ftbridge.comm_hooks`), passed as ``ftbridge.initialize(..., comm_hook=...)``; the main job's script
selects one with a testing flag (:func:`from_args`). Nothing in ftbridge's own code path knows about them.

* :func:`no_sync_hook` (``--no-cross-replica-sync``): each group keeps its own gradient; the groups diverge.
* :func:`sum_hook` (``--test-sync-sum``): a SUM instead of the average; a missing division by the
  participants, which the equivalence tests must catch.
* :func:`corrupting_hook` (``--corrupt-sync-at GROUP:STEP``): the average, then tripled on one group at one
  step: a silent divergence for the divergence guard (``FTBRIDGE_GUARD_EVERY``) to find and heal.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Optional

import torch

from ftbridge.comm_hooks.base import CommHookState, wait_result
from ftbridge.comm_hooks.default import allreduce_hook

Hook = Callable[[CommHookState, torch.Tensor], Any]


def no_sync_hook(state: CommHookState, tensor: torch.Tensor) -> torch.futures.Future:
    """Leave ``tensor`` as it is: no cross-replica communication (the groups diverge)."""
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(tensor)
    return done


def sum_hook(state: CommHookState, tensor: torch.Tensor) -> Any:
    """Sum ``tensor`` over the participating groups without dividing by their number."""
    return state.allreduce(tensor, average=False)


class _Tripled:
    """A hook's work whose result is multiplied by 3 once it is in."""

    def __init__(self, work: Any, tensor: torch.Tensor) -> None:
        self._work, self._tensor = work, tensor

    def wait(self, timeout: Any = None) -> bool:
        done = wait_result(self._work, self._tensor)
        if done:
            self._tensor.mul_(3.0)
        return done


def corrupting_hook(group: int, step: int) -> Hook:
    """The plain average, tripled on replica group ``group`` for the update that makes step ``step``.

    Args:
        group: replica group id (read from the hook state at each call: a warm spare may take an id).
        step: the committed step the corrupted update produces (>= 1).
    """
    def hook(state: CommHookState, tensor: torch.Tensor) -> Any:
        work = allreduce_hook(state, tensor)
        if state.manager.cfg.replica_group_id == group and state.step + 1 == step:
            return _Tripled(work, tensor)
        return work

    return hook


def from_args(args: argparse.Namespace) -> Optional[Hook]:
    """The control hook the main job's testing flags ask for (``None``: none).

    Raises:
        ValueError: two testing flags, or one with ``--comm-hook``: each replaces the communication hook.
    """
    chosen = [flag for flag, on in (("--no-cross-replica-sync", args.no_cross_replica_sync),
                                    ("--test-sync-sum", args.test_sync_sum),
                                    ("--corrupt-sync-at", bool(args.corrupt_sync_at))) if on]
    if args.comm_hook and chosen:
        raise ValueError(f"{chosen[0]} replaces the communication hook: drop --comm-hook {args.comm_hook}")
    if len(chosen) > 1:
        raise ValueError(f"{' and '.join(chosen)} each replace the communication hook: use one")
    if args.no_cross_replica_sync:
        return no_sync_hook
    if args.test_sync_sum:
        return sum_hook
    if args.corrupt_sync_at:
        group, step = (int(x) for x in args.corrupt_sync_at.split(":"))
        return corrupting_hook(group, step)
    return None
