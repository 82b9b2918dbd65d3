"""Warm spares in a chaos run: who holds a group id now, who stands by, how many takeovers.

With ``ChaosSettings.spares = K`` the runner starts spares ``0..K-1``
(``ftbridge-run --spare-index k``, :mod:`ftbridge.spare`) once the job commits
together. From then on a replica group id ``G`` may be held by G's own
launch, by a spare that took it over, or by G's torchrun restart; the
process that holds it writes to G's event log and its latest ``start``
record there names its PID. Standing-by processes (the launched spares, a
spare's torchrun restart, and a restart of G that found its id taken and
was *demoted* to spare ``N + G``) write ``spare_ready`` records to the log
of id ``N + index`` and never a ``start`` to a group's log until they take
one over.

The decisions here are pure functions of event records, so the unit tests
need no processes: the failure targets are the holders (:func:`holders`),
never a standing-by spare; at the end every live launch that holds no group
is stopped by PID (:func:`standing_by`); the report counts takeovers
(:func:`takeovers`).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Sequence, Set

from ftbridge.harness.local_job import live_starts

Record = Dict[str, Any]


def validate_spares(spares: int, groups: int) -> None:
    """Refuse a spare count the chaos run cannot use.

    Args:
        spares: warm spares to start (``--spares``).
        groups: planned replica groups ``N``.

    Raises:
        ValueError: ``spares`` is negative, or above ``groups`` (spare index
            ``N`` would share its stand-by id and event log with group 0's
            demoted restart, which ftbridge numbers ``N + G``).
    """
    if spares < 0:
        raise ValueError(f"--spares {spares}: must be 0 (no warm spare) or a positive count")
    if spares > groups:
        raise ValueError(f"--spares {spares} with --groups {groups}: at most one spare per replica group (spare "
                         f"index {groups} would collide with group 0's demoted restart, index N + G); "
                         f"use --spares {groups} or fewer")


def spare_ids(num_groups: int, spares: int) -> List[int]:
    """Event-log ids of every possible standing-by process (``N + index``).

    Launched spares have indices ``0..spares-1``; a demoted restart of group
    ``G`` has index ``N + G``. Returns the ids ``N + index``, sorted.
    """
    return sorted({num_groups + k for k in range(spares)} | {2 * num_groups + g for g in range(num_groups)})


def holders(events: Iterable[Record], groups: Iterable[int],
            running: Callable[[int, float], bool] = lambda pid, t: True) -> Dict[int, Dict[int, int]]:
    """The PIDs that hold each group id now: ``{group: {group rank: pid}}``.

    Per rank, the latest ``start`` record whose process still runs
    (:func:`ftbridge.harness.local_job.live_starts`). Not simply the latest: a restart
    of a group may join while the spare holding its id is paused (or while the lighthouse is down, so it
    cannot see the id is taken), meet the spare in a quorum and leave (:func:`ftbridge.spare.must_leave`)
    after writing its ``start``; the spare keeps the id.

    Args:
        events: event records of the groups' logs (any order).
        groups: the group ids to report (groups with no running ``start`` get ``{}``).
        running: ``running(pid, start_time)``: whether that process still runs (and is the one that
            wrote the record, not a reused PID); default: every one does.
    """
    live = live_starts(list(events), running)
    return {g: {r: starts[-1]["pid"] for (gg, r), starts in sorted(live.items()) if gg == g} for g in groups}


def standing_by(ready: Iterable[Record], held: Set[int]) -> List[int]:
    """PIDs that announced ``spare_ready`` and hold no group id now (sorted; liveness is the caller's)."""
    return sorted({e["pid"] for e in ready if e.get("event") == "spare_ready" and "pid" in e} - set(held))


def takeovers(events: Sequence[Record]) -> List[Record]:
    """The ``spare_join`` records of group rank 0 (one per takeover), oldest first."""
    return sorted((e for e in events if e.get("event") == "spare_join" and e.get("group_rank") == 0),
                  key=lambda e: e["time"])


SCALE_DOWN_WITH_SPARES = ("warm spares run: one would take the leaving group's id as soon as the lighthouse "
                          "drops it (a spare cannot tell a group that left from one that died), so the group "
                          "would not leave")
"""Why a chaos run with spares skips ``scale_down`` (the report shows it)."""
