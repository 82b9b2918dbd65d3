"""Do the lighthouse's timeouts fit the managers' settings? A pure check.

:func:`check_timeouts` applies the rules ``heartbeat-interval``, ``quorum-wait``, ``heal-time``
(ERROR: refuse to start) and ``departure-wait``, ``heal-join``, ``restart-retries``, ``restart-outage``
(WARNING), in that order; conditions and reasons: ``docs/lighthouse.md``, "Timeout checks". :func:`enforce` acts
on them.

Example::

    findings = check_timeouts(LighthouseTimeouts(...), ManagerTimeouts.from_config(cfg))
    enforce(findings)          # raises ValueError on any ERROR, logs the WARNINGs
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, List, Optional

logger = logging.getLogger("lighthouse")

RECONNECT_ALLOWANCE = timedelta(seconds=2)
"""Time a manager needs to notice a restarted lighthouse is back and send its quorum again."""

DEPARTURE_MARGIN = timedelta(seconds=1)
"""Least time between the survivors' quorum after a group dies and the end of the first try of their call."""


@dataclass(frozen=True, kw_only=True)
class LighthouseTimeouts:
    """The lighthouse's timing settings (ms, as on its command line)."""

    heartbeat_timeout_ms: int
    join_timeout_ms: int
    quorum_tick_ms: int


@dataclass(frozen=True, kw_only=True)
class ManagerTimeouts:
    """The managers' timing settings (as in :class:`ftbridge.config.FTBridgeConfig`)."""

    heartbeat_interval: timedelta
    quorum_timeout: timedelta
    cross_replica_timeout: timedelta
    quorum_retries: int
    expected_heal_time: timedelta = timedelta(seconds=1)
    """How long one heal transfer is expected to take (state size / bandwidth)."""
    expected_outage: timedelta = timedelta(seconds=10)
    """Longest lighthouse outage (restart) the job should ride out."""

    @classmethod
    def from_config(cls, cfg: Any, *, expected_heal_time: Optional[timedelta] = None,
                    expected_outage: Optional[timedelta] = None) -> "ManagerTimeouts":
        """Take the fields from an :class:`~ftbridge.config.FTBridgeConfig`."""
        extra = {k: v for k, v in (("expected_heal_time", expected_heal_time),
                                   ("expected_outage", expected_outage)) if v is not None}
        return cls(heartbeat_interval=cfg.heartbeat_interval, quorum_timeout=cfg.quorum_timeout,
                   cross_replica_timeout=cfg.cross_replica_timeout, quorum_retries=cfg.quorum_retries, **extra)


@dataclass(frozen=True)
class Finding:
    """One violated rule."""

    level: str
    """``"ERROR"`` (refuse) or ``"WARNING"``."""
    rule: str
    """Short rule name, as in ``docs/lighthouse.md``'s table."""
    message: str
    """The values involved, the rule, and the fix."""


def _s(td: timedelta) -> str:
    return f"{td.total_seconds():g} s"


def check_timeouts(lh: LighthouseTimeouts, mgr: ManagerTimeouts) -> List[Finding]:
    """The violated rules, errors and warnings in rule order; empty when all fit (pure, no I/O).

    Args:
        lh: the lighthouse's settings (ms).
        mgr: the managers' settings.
    """
    out: List[Finding] = []
    hb_timeout = timedelta(milliseconds=lh.heartbeat_timeout_ms)
    join = timedelta(milliseconds=lh.join_timeout_ms)
    tick = timedelta(milliseconds=lh.quorum_tick_ms)

    if hb_timeout <= 2 * mgr.heartbeat_interval:
        out.append(Finding("ERROR", "heartbeat-interval",
                           f"heartbeat_timeout_ms={lh.heartbeat_timeout_ms} is not above 2 x the managers' "
                           f"heartbeat_interval={_s(mgr.heartbeat_interval)}: one late heartbeat would declare a live "
                           "replica group dead; raise heartbeat_timeout_ms (>= 5 x the interval) "
                           "or lower the interval"))
    elif hb_timeout < 5 * mgr.heartbeat_interval:
        out.append(Finding("WARNING", "heartbeat-interval",
                           f"heartbeat_timeout_ms={lh.heartbeat_timeout_ms} is below 5 x the managers' "
                           f"heartbeat_interval={_s(mgr.heartbeat_interval)}: a few delayed heartbeats would "
                           "declare a live replica group dead"))
    wait = min(join, hb_timeout) + tick
    one_try = mgr.quorum_timeout / (max(mgr.quorum_retries, 0) + 1)
    if wait >= one_try:
        out.append(Finding("ERROR", "quorum-wait",
                           f"min(join_timeout_ms={lh.join_timeout_ms}, heartbeat_timeout_ms={lh.heartbeat_timeout_ms})"
                           f" + quorum_tick_ms={lh.quorum_tick_ms} = {_s(wait)} is not below one try of the managers' "
                           f"quorum call, quorum_timeout={_s(mgr.quorum_timeout)} / (quorum_retries="
                           f"{mgr.quorum_retries} + 1) = {_s(one_try)}: a quorum waiting for a straggler would outlast "
                           "every try; lower join_timeout_ms, raise quorum_timeout or lower quorum_retries"))
    departure = hb_timeout + tick + DEPARTURE_MARGIN
    if wait < one_try <= departure:
        out.append(Finding("WARNING", "departure-wait",
                           f"heartbeat_timeout_ms={lh.heartbeat_timeout_ms} + quorum_tick_ms={lh.quorum_tick_ms} + "
                           f"{_s(DEPARTURE_MARGIN)} = {_s(departure)} is not below one try of the managers' quorum "
                           f"call ({_s(one_try)}): when one of two groups dies, the survivor's quorum waits out its "
                           "heartbeat timeout and forms as that try ends, and the lighthouse can issue it to the try "
                           "that just gave up (ftbridge reads it back from the status page, but one replaced within "
                           "milliseconds is missed and stops the group with QuorumGap); lower heartbeat_timeout_ms "
                           "or raise quorum_timeout"))
    if mgr.expected_heal_time >= mgr.cross_replica_timeout:
        out.append(Finding("ERROR", "heal-time",
                           f"expected_heal_time={_s(mgr.expected_heal_time)} is not below cross_replica_timeout="
                           f"{_s(mgr.cross_replica_timeout)}: the donor's peers wait for it in the cross-replica "
                           "all-reduce while it sends, and the transfer itself is bounded by that timeout; raise "
                           "cross_replica_timeout (and in_group_timeout above it)"))
    if join < mgr.expected_heal_time:
        out.append(Finding("WARNING", "heal-join",
                           f"join_timeout_ms={lh.join_timeout_ms} is below expected_heal_time="
                           f"{_s(mgr.expected_heal_time)}: a group that just healed joins its next quorum late and "
                           "the others go on without it for a step (it heals again; harmless but slower)"))
    if mgr.quorum_retries < 1:
        out.append(Finding("WARNING", "restart-retries",
                           f"quorum_retries={mgr.quorum_retries}: a lighthouse restart or network blip fails every "
                           "manager's quorum call and kills every rank; set quorum_retries >= 1 "
                           "(ftbridge's default is 5)"))
    needed = mgr.expected_outage + join + RECONNECT_ALLOWANCE
    if mgr.quorum_timeout < needed:
        out.append(Finding("WARNING", "restart-outage",
                           f"quorum_timeout={_s(mgr.quorum_timeout)} does not cover expected_outage="
                           f"{_s(mgr.expected_outage)} + join_timeout_ms={lh.join_timeout_ms} + reconnect "
                           f"{_s(RECONNECT_ALLOWANCE)} = {_s(needed)}: a lighthouse restart that long fails every "
                           "quorum call (torchft bounds one call, retries included, by quorum_timeout)"))
    return out


def enforce(findings: List[Finding], log: logging.Logger = logger) -> None:
    """Log every WARNING; raise on ERRORs.

    Raises:
        ValueError: one or more ERROR findings, all their messages joined.
    """
    for f in findings:
        if f.level == "WARNING":
            log.warning("timeout check %s: %s", f.rule, f.message)
    errors = [f"[{f.rule}] {f.message}" for f in findings if f.level == "ERROR"]
    if errors:
        raise ValueError("lighthouse and manager timeouts do not fit:\n" + "\n".join(errors))
