"""The ranks of one replica group apply a heal together or not at all: :class:`HealAgreement` (torchft 0.2
internals, built only where :func:`ftbridge.manager.torchft_api.internals_supported` holds).

Why: docs/concepts.md, "Heal" (the load ends with an in-group collective).
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional, Tuple

logger = logging.getLogger(__name__)


class DiscardStep(RuntimeError):
    """An error recorded to discard a step on purpose; a heal received in the step still applies
    (:meth:`HealAgreement.state`)."""


def _harmless(error: Any) -> bool:
    """Whether torchft's recorded ``error`` (wrapped or not) is a :class:`DiscardStep`."""
    return isinstance(getattr(error, "original_exception", error), DiscardStep)


class HealAgreement:
    """The ranks of one replica group apply a heal together or not at all.

    Each rank reports :meth:`state` in the group's in-group exchange; every rank then calls :meth:`settle`
    with the group's decision. It wraps ``manager.load_state_dict`` (a ``torchft.Manager`` or a stand-in with
    its fields) so a dropped heal also restores torchft's counters.
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
        """``(healing, ready)``: this rank heals in this step, and holds its complete heal state with no error but a
        :class:`DiscardStep`; call after ``wait_quorum``."""
        m = self._manager
        healing = bool(getattr(m, "_healing", False))
        error = m.errored()
        return healing, (healing and getattr(m, "_pending_state_dict", None) is not None
                         and (error is None or _harmless(error)))

    def settle(self, drop: bool) -> None:
        """Apply the group's decision; with ``drop``, drop this rank's received state, restore torchft's counters and
        record an error. Every rank, every step, after :meth:`state`."""
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
