"""Divergence guard: replica groups compare a fingerprint of their state every N committed steps, by majority.

The gradient sync is meant to keep every replica group identical after every
commit (:mod:`ftbridge.zero.grad_sync`); the guard checks that it did, so a
bug of that kind (a sync that pairs the wrong gradients, a hook that skips a
bucket, a kernel that is not deterministic across machines, a corrupted
update) shows up as an event and is repaired or stops the job, instead of
training on quietly on different models.

Every ``guard_every`` committed steps (``FTBRIDGE_GUARD_EVERY``; 0 turns it
off), in the next step, each participating rank takes a SHA-256 fingerprint
of what its optimizer steps on (the fp32 master partition and its optimizer
state, :meth:`ftbridge.zero.adapter.ZeroAdapter.fingerprint_tensors`) and puts
it in the step's cross-replica agreement (:mod:`ftbridge.manager.commit`), which
every member judges the same way (:func:`ftbridge.manager.commit.judge_guard`):
the state held by more than half of the groups is taken as right; no group,
the quorum's primary included, is the reference. The group's one in-group
exchange then gives every rank of a group the same verdict.

On a mismatch the guard writes a ``divergence`` event (step, the majority's
groups, the differing groups, every fingerprint) and logs it; then:

* ``guard_action="heal"`` (default) with a majority: the outvoted groups
  discard the step while the others commit; one step behind, they heal from a
  group of the majority at the next quorum (their step record names the donor);
* no majority (two groups that differ, or a tie): ``guard_on_tie="stop"``
  (default) stops every group with :class:`ReplicaDivergenceError`, naming the
  fingerprints; ``"flag"`` writes the event on every check and trains on;
* ``guard_action="stop"``: every rank of every group raises
  :class:`ReplicaDivergenceError` on any mismatch.

Cost: one pass over the partition and its optimizer state (SHA-256, about
0.5 GB/s on one core) every ``guard_every`` steps; the fingerprint rides in the
agreement, which every step makes anyway. ``ftbridge-bench overhead`` reports it.
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
        """Record and act on this step's verdict (every rank of every group calls it after the decision).

        Args:
            step: the committed step the fingerprints were taken after.
            verdict: this rank's guard verdict from the agreement (``None``: no fingerprints).
            decision: the group's decision (its ``guard_*`` flags span every rank of the group).

        Raises:
            ReplicaDivergenceError: a mismatch with ``action="stop"``, or without a majority with
                ``on_tie="stop"`` (on every rank of every group: each sees the same flags).
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
