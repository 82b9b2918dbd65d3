"""Divergence guard: replica groups compare a fingerprint of their state every N committed steps, by majority.

Every ``guard_every`` committed steps each participating rank puts a SHA-256
fingerprint of its fp32 master partition and optimizer state
(:meth:`ftbridge.zero.adapter.ZeroAdapter.fingerprint_tensors`) into the next
step's agreement, judged alike by every member
(:func:`ftbridge.manager.commit.judge_guard`); :class:`DivergenceGuard` records
the verdict and acts on it (``guard_action``, ``guard_on_tie``). Why and what
each setting does: docs/concepts.md, "The divergence guard".
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

from ftbridge.events import tensor_checksum
from ftbridge.manager.commit import GroupDecision, GuardVerdict

logger = logging.getLogger(__name__)


class ReplicaDivergenceError(RuntimeError):
    """Replica groups hold different state after a commit, and the settings say stop."""


class DivergenceGuard:
    """The fingerprint a rank reports when due, and what it does with the verdict.

    Args:
        adapter: the engine's ZeRO adapter (``fingerprint_tensors``).
        replica_group_id: this rank's replica group.
        every: committed steps between checks (0: never).
        action: ``"heal"`` or ``"stop"``.
        on_tie: ``"stop"`` or ``"flag"``: what a mismatch without a majority does.
        events: the engine's event log.

    Raises:
        ValueError: ``every < 0`` or an unknown ``action``/``on_tie``.
    """

    def __init__(self, adapter: Any, *, replica_group_id: int, every: int, action: str, on_tie: str = "stop",
                 events: Any) -> None:
        if every < 0 or action not in ("heal", "stop") or on_tie not in ("stop", "flag"):
            raise ValueError(f"guard every={every} (>= 0), action={action!r} ('heal' or 'stop'), "
                             f"on_tie={on_tie!r} ('stop' or 'flag')")
        self.adapter, self.group_id = adapter, replica_group_id
        self.every, self.action, self.on_tie, self.events = every, action, on_tie, events
        self.checks = 0
        """Guard checks that compared at least two replicas."""
        self.mismatches = 0
        """Checks that found a replica differing."""
        self.seconds = 0.0
        """Wall time spent fingerprinting, seconds."""

    def due(self, step: int) -> bool:
        """Whether the state after committed step ``step`` is checked."""
        return self.every > 0 and step > 0 and step % self.every == 0

    def digest(self, step: int) -> Optional[str]:
        """This rank's fingerprint (16 hex digits) of the state after step ``step`` when due, else ``None``."""
        if not self.due(step):
            return None
        t0 = time.perf_counter()
        digest = tensor_checksum(self.adapter.fingerprint_tensors())
        self.seconds += time.perf_counter() - t0
        return digest

    def act(self, step: int, verdict: Optional[GuardVerdict], decision: GroupDecision) -> None:
        """Record and act on this step's verdict (every rank of every group, after the decision).

        Args:
            step: the committed step the fingerprints were taken after.
            verdict: this rank's guard verdict from the agreement (``None``: no fingerprints).
            decision: the group's decision (its ``guard_*`` flags span every rank of the group).

        Raises:
            ReplicaDivergenceError: a mismatch with ``action="stop"``, or without a majority with
                ``on_tie="stop"`` (on every rank of every group).
        """
        if verdict is not None and len(verdict.digests) > 1:
            self.checks += 1
        if not decision.guard_mismatch:
            return
        self.mismatches += 1
        v = verdict or GuardVerdict({}, None, (), ())
        stop = self.action == "stop" or (decision.guard_tie and self.on_tie == "stop")
        what = ("heal" if decision.guard_differs else "go on") if not stop else "stop"
        self.events.write(event="divergence", time=time.time(), step=step, differing_groups=list(v.differing),
                          majority_groups=list(v.agreeing), tie=decision.guard_tie,
                          digests={str(k): d for k, d in sorted(v.digests.items())}, action=what,
                          this_group_differs=decision.guard_differs)
        if decision.guard_tie:
            logger.error("DIVERGENCE after step %d: replica groups hold different states and none is held by a "
                         "majority (%s); %s", step, _by_state(v),
                         "stopping" if stop else "training on (FTBRIDGE_GUARD_ON_TIE=flag)")
        else:
            logger.warning("DIVERGENCE after step %d: replica group(s) %s differ from the majority %s; %s", step,
                           list(v.differing) or "(on another rank of this group)", list(v.agreeing),
                           "stopping" if stop else "they discard this step and heal from the majority at the next")
        if stop:
            raise ReplicaDivergenceError(
                f"replica groups hold different parameters or optimizer state after step {step}: {_by_state(v)}. "
                + ("No state is held by a majority, so none can be named right: resume every group from a "
                   "checkpoint taken before the divergence (or set FTBRIDGE_GUARD_ON_TIE=flag to train on)"
                   if decision.guard_tie else
                   "Set FTBRIDGE_GUARD_ACTION=heal to heal the outvoted groups from the majority instead"))


def _by_state(v: GuardVerdict) -> str:
    groups: dict = {}
    for g, d in sorted(v.digests.items()):
        groups.setdefault(d, []).append(g)
    return ", ".join(f"groups {gs} hold {d}" for d, gs in groups.items()) or "fingerprints on another rank"
