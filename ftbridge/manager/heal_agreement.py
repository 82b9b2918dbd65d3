"""The ranks of one replica group apply a heal together or not at all (torchft 0.2 internals).

:class:`HealAgreement` reads torchft's ``Manager._healing`` and
``_pending_state_dict``; :class:`ftbridge.manager.ReplicaManager` builds it only
where :func:`ftbridge.manager.torchft_api.internals_supported` holds.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional, Tuple

logger = logging.getLogger(__name__)


class DiscardStep(RuntimeError):
    """An error recorded to discard a step on purpose, with nothing broken: a heal received in the step
    still applies (:meth:`HealAgreement.state`), so the retry finds every member at one step."""


def _harmless(error: Any) -> bool:
    """Whether torchft's recorded ``error`` (its ``ExceptionWithTraceback`` or the exception) is a
    :class:`DiscardStep`."""
    return isinstance(getattr(error, "original_exception", error), DiscardStep)


class HealAgreement:
    """The ranks of one replica group apply a heal together or not at all (torchft 0.2 internals).

    torchft heals per rank: each group rank of a joining group fetches the
    state of the same group rank in a healthy group on torchft's quorum
    thread, and ``should_commit`` applies it. ftbridge's load ends with a
    collective inside the group (ZeRO-1/2 all-gather the updated parameters;
    ZeRO-3 wraps the load in its checkpoint events), so either every rank of
    the group loads, or none may. Each rank reports :meth:`state` in the
    group's one in-group exchange (:meth:`ftbridge.manager.ReplicaManager.decide`),
    and every rank then calls :meth:`settle` with the group's decision.

    torchft also loads its own counters (``step``, ``batches_committed``)
    from the donor as soon as a rank's fetch succeeds; a dropped heal must
    take those back too, or the ranks of the group report different steps.
    The constructor wraps the manager's ``load_state_dict`` to remember them.

    Args:
        manager: the rank's ``torchft.Manager`` (or an object with the same
            ``state_dict``/``load_state_dict``/``errored``/``report_error``
            and ``_healing``/``_pending_state_dict``).
    """

    def __init__(self, manager: Any) -> None:
        self._manager = manager
        self._before: Optional[Dict[str, Any]] = None
        self._load_counters = manager.load_state_dict

        def load_state_dict(state: Any) -> None:  # torchft's quorum thread, right after a fetch
            self._before = manager.state_dict()
            self._load_counters(state)

        manager.load_state_dict = load_state_dict

    def state(self) -> Tuple[bool, bool]:
        """``(healing, ready)`` of this rank: it heals in this step, and holds its complete heal state
        with no error recorded but a :class:`DiscardStep`.

        Call after the step's quorum is applied (``wait_quorum``).
        """
        m = self._manager
        healing = bool(getattr(m, "_healing", False))
        error = m.errored()
        return healing, (healing and getattr(m, "_pending_state_dict", None) is not None
                         and (error is None or _harmless(error)))

    def settle(self, drop: bool) -> None:
        """Apply the group's decision: with ``drop``, this rank's received state is dropped, torchft's
        counters go back to their values before the heal, and an error is recorded (the step is
        discarded; the next quorum heals again). Call on every rank, every step, after :meth:`state`."""
        before, self._before = self._before, None
        if not drop:
            return
        m = self._manager
        m._pending_state_dict = None
        if before is not None:  # torchft already took the donor's step: take it back
            self._load_counters(before)
        if m.errored() is None:
            m.report_error(RuntimeError(
                "another rank of this replica group did not receive its heal state (its donor died or the "
                "transfer broke); no rank applies a heal this step, the next quorum heals again"))
        logger.warning("heal dropped: a rank of this replica group failed to receive its state")
