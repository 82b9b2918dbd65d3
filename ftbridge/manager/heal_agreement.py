"""The ranks of one replica group apply a heal together or not at all (torchft 0.2 internals).

:class:`HealAgreement` reads torchft's ``Manager._healing`` and
``_pending_state_dict``; :class:`ftbridge.manager.ReplicaManager` builds it only
where :func:`ftbridge.manager._torchft.internals_supported` holds.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from ftbridge.device import collective_device, group_backend

logger = logging.getLogger(__name__)


class HealAgreement:
    """The ranks of one replica group apply a heal together or not at all (torchft 0.2 internals).

    torchft heals per rank: each group rank of a joining group fetches the
    state of the same group rank in a healthy group on torchft's quorum
    thread, and ``should_commit`` applies it. ftbridge's load ends with a
    collective inside the group (ZeRO-1/2 all-gather the updated parameters;
    ZeRO-3 wraps the load in its checkpoint events), so either every rank of
    the group loads, or none may. If a donor dies half-way, some ranks may
    hold a complete state and others none: left alone, the group would hang
    in that collective until the in-group timeout. :meth:`agree` prevents it
    with one small all-reduce inside the group, only in a step that heals.

    torchft also loads its own counters (``step``, ``batches_committed``)
    from the donor as soon as a rank's fetch succeeds; a dropped heal must
    take those back too, or the ranks of the group report different steps.
    The constructor wraps the manager's ``load_state_dict`` to remember them.

    There is no public torchft API for "did this rank's fetch succeed": this
    reads ``_healing`` and ``_pending_state_dict``, so :class:`ftbridge.manager.ReplicaManager`
    builds it only for the torchft versions in
    :data:`ftbridge.manager._torchft.TORCHFT_GUARDED_VERSIONS`.

    Args:
        manager: the rank's ``torchft.Manager`` (or an object with the same
            ``state_dict``/``load_state_dict``/``wait_quorum``/``errored``/
            ``report_error`` and ``_healing``/``_pending_state_dict``).
    """

    def __init__(self, manager: Any) -> None:
        self._manager = manager
        self._before: Optional[Dict[str, Any]] = None
        self._load_counters = manager.load_state_dict

        def load_state_dict(state: Any) -> None:  # torchft's quorum thread, right after a fetch
            self._before = manager.state_dict()
            self._load_counters(state)

        manager.load_state_dict = load_state_dict

    def agree(self, group: Optional[Any] = None) -> bool:
        """Whether this step's heal state may be applied; call on every rank of the group before ``should_commit``.

        Args:
            group: the replica group's process group (default: the default
                world, which ftbridge makes the replica group).

        Returns:
            ``True`` if this step does not heal, or every rank of the group
            holds its complete heal state. ``False`` if any rank failed: this
            rank's received state is dropped, an error is reported to torchft
            (the step is discarded on every replica and the next quorum heals
            again), and torchft's counters are put back to their values
            before the heal.
        """
        m = self._manager
        if not getattr(m, "_healing", False):
            return True
        m.wait_quorum()  # the fetch runs on torchft's quorum thread
        ok = getattr(m, "_pending_state_dict", None) is not None and m.errored() is None
        flag = torch.tensor([int(ok)], dtype=torch.int32, device=collective_device(group_backend(group)))
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        before, self._before = self._before, None
        if flag.item():
            return True
        m._pending_state_dict = None
        if before is not None:  # torchft already took the donor's step: take it back
            self._load_counters(before)
        if ok:
            m.report_error(RuntimeError(
                "another rank of this replica group did not receive its heal state (its donor died or the "
                "transfer broke); no rank applies a heal this step, the next quorum heals again"))
            logger.warning("heal dropped: another rank of this replica group failed to receive its state")
        return False
