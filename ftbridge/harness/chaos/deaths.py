"""Which ranks died in a chaos run, and whether a failure explains each death.

A rank that dies although no injected failure hit its replica group is a
*collateral death*: the fault-tolerance promise says the others go on. The
deaths come from torchrun's own log lines in each group's launcher log
(``failed (exitcode: N) local_rank: R (pid: P)``), the rank's identity and
launch time from its event log (a ``start`` record names the pid), and what
happened to it from the log lines before its death. Pure functions of text and
records: unit-tested on samples and re-run on any finished run's logs.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

Record = Dict[str, Any]

_FAILED = re.compile(r"^E(\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d+) .*failed \(exitcode: (-?\d+)\) "
                     r"local_rank: (\d+) \(pid: (\d+)\)")
_CAUSE = re.compile(r"\bERROR\b|Error\b|Exception\b|Timeout|killed|exit")
SIGNATURE_LINES = 3
"""How many of the rank's last telling log lines a death's signature keeps."""


@dataclass(frozen=True)
class Death:
    """One worker process that torchrun saw fail.

    Attributes:
        pid: the worker's process id.
        exitcode: as torchrun reports it (negative: killed by that signal number).
        time: when torchrun noticed, seconds since the epoch (local time of the log, second resolution).
        line: index of torchrun's line in the launcher log.
    """

    pid: int
    exitcode: int
    time: float
    line: int


def deaths_in_log(text: str, year: int) -> List[Death]:
    """Every ``failed (exitcode ...)`` line of a torchrun launcher log.

    Args:
        text: the launcher log (torchrun's own lines and its workers' output).
        year: the year the run took place (torchrun's glog timestamps carry month and day only).
    """
    out = []
    for i, line in enumerate(text.splitlines()):
        m = _FAILED.search(line)
        if m:
            mon, day, hh, mm, ss, frac, code, _rank, pid = m.groups()
            t = time.mktime((year, int(mon), int(day), int(hh), int(mm), int(ss), 0, 0, -1))
            out.append(Death(int(pid), int(code), t + float(f"0.{frac}"), i))
    return out


def signature(text: str, death: Death) -> str:
    """The death's exit code and the last few telling lines (errors, timeouts, exits) of its launch: after
    torchrun's previous ``failed`` line in the same log, before this one."""
    lines = text.splitlines()[:death.line]
    start = max((i + 1 for i, ln in enumerate(lines) if _FAILED.search(ln)), default=0)
    telling = [ln.strip() for ln in lines[start:] if _CAUSE.search(ln) and "launcher] running:" not in ln]
    tail = " | ".join(ln[:200] for ln in telling[-SIGNATURE_LINES:]) or "(no error line before it)"
    return f"exitcode {death.exitcode}: {tail}"


def launches(events: Sequence[Record]) -> Dict[int, Tuple[int, int, float]]:
    """pid -> (replica group, group rank, start time) from the ``start`` records."""
    out: Dict[int, Tuple[int, int, float]] = {}
    for e in events:
        if e.get("event") == "start" and "pid" in e:
            out.setdefault(int(e["pid"]), (int(e["replica_group"]), int(e["group_rank"]), float(e["time"])))
    return out


Hit = Tuple[float, float, Sequence[int]]
"""An injected failure: (when it began, when the job had recovered from it, the groups it hit or brought back)."""


def collateral(deaths: Sequence[Death], events: Sequence[Record], hits: Sequence[Hit],
               slack_s: float = 1.0, until: float = float("inf")) -> List[Tuple[Death, int, int]]:
    """The deaths no injected failure explains: ``(death, replica group, group rank)`` for each.

    A death of a rank of group ``g`` is explained when it falls between the beginning of a failure that hit
    ``g`` and the job's recovery from it (``slack_s`` either side, for the log's times): one failure may
    kill a group's launch and then the launch torchrun restarted (a joiner killed in its heal); or when
    another process held the same rank of ``g`` at that moment (:func:`_displaced`). A process
    with no ``start`` record (it died before it began training: a restart that could not start) is not
    judged here.

    Args:
        deaths: from :func:`deaths_in_log`.
        events: the run's merged event records.
        hits: the injected failures (:data:`Hit`).
        slack_s: tolerance on the times, seconds.
        until: deaths from this time on are not judged (the run's own stop: stand-by spares and restarts
            that hold no group are ended then).
    """
    starts = launches(events)
    last_seen: Dict[int, float] = {}
    for e in events:
        if "pid" in e:
            last_seen[int(e["pid"])] = max(last_seen.get(int(e["pid"]), 0.0), float(e["time"]))
    out = []
    for d in deaths:
        if d.pid not in starts or d.time >= until:
            continue
        g, r, _ = starts[d.pid]
        if any(g in groups and began - slack_s <= d.time <= done + slack_s for began, done, groups in hits):
            continue
        if not _displaced(d, (g, r), starts, last_seen):
            out.append((d, g, r))
    return out


def _displaced(death: Death, holds: Tuple[int, int], starts: Mapping[int, Tuple[int, int, float]],
               last_seen: Mapping[int, float]) -> bool:
    """Another process held the same rank of the same group when ``death`` happened: it had started as it
    before and wrote a record after. Two holders of one group id (a spare took the id of a group that was
    paused or cut off from the lighthouse, or a restart came back while the spare held it) is resolved by
    one of them leaving (:class:`ftbridge.spare.DuplicateReplicaGroup`): that death is by design."""
    return any(pid != death.pid and (g, r) == holds and began < death.time < last_seen.get(pid, 0.0)
               for pid, (g, r, began) in starts.items())


def collateral_in_logs(logs: Mapping[str, str], events: Sequence[Record],
                       hits: Sequence[Hit], year: Optional[int] = None,
                       until: float = float("inf")) -> List[str]:
    """One line per collateral death in the launcher logs ``{path: text}``, with its signature
    (:func:`collateral`'s arguments)."""
    year = year or time.localtime().tm_year
    out = []
    for _path, text in sorted(logs.items()):
        for d, dg, r in collateral(deaths_in_log(text, year), events, hits, until=until):
            when = time.strftime("%H:%M:%S", time.localtime(d.time))
            out.append(f"replica group {dg} rank {r} (pid {d.pid}) died at {when} with no failure aimed at it: "
                       f"{signature(text, d)}")
    return out
