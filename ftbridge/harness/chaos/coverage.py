"""The "same samples" invariant of a chaos run with slots: every committed step trained its whole grid once.

With slots (``FTBRIDGE_SLOTS``), each step record of a committed step carries ``units``: the
``[slot, micro]`` pairs its group computed, in order (:mod:`ftbridge.slots.steps`). The groups that
committed one step in one quorum must together have computed every unit of the grid (``slots`` x
``micro`` pairs) exactly once, on every group rank: the samples of the failure-free run, whatever
failed. A group whose record is missing (it died between its commit and its record) leaves the
check to no unit twice and none outside the grid.

Pure: event records in, a :class:`~ftbridge.harness.chaos.invariants.Check` out.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Dict, List, Sequence, Tuple

from ftbridge.harness.chaos.invariants import Check, Record, Violation

NAME = "same samples as the failure-free run"


def same_samples(events: Sequence[Record], slots: int, micro: int) -> Check:
    """Every committed step, on every group rank, covered the grid exactly once (see the module).

    Args:
        events: the run's merged event records.
        slots: the job's slots (N).
        micro: micro-batches per slot (``gradient_accumulation_steps``).
    """
    grid = Counter((s, m) for s in range(slots) for m in range(micro))
    commits: Dict[Tuple[Any, Any, Any], List[Record]] = {}
    for e in events:
        if "event" not in e and e.get("committed"):
            commits.setdefault((e["step"], e.get("quorum_id"), e["group_rank"]), []).append(e)
    out = []
    for (step, quorum, rank), records in sorted(commits.items(), key=lambda kv: str(kv[0])):
        where = f"step {step} quorum {quorum} group rank {rank}"
        if any(not isinstance(r.get("units"), list) for r in records):
            out.append(Violation(NAME, f"{where}: a commit without its units (was the job run with slots?)"))
            continue
        got = Counter((int(s), int(m)) for r in records for s, m in r["units"])
        twice = sorted(u for u, n in got.items() if n > 1)
        outside = sorted(u for u in got if u not in grid)
        whole = len(records) >= max(int(r.get("participants") or 0) for r in records)
        missing = sorted(u for u in grid if u not in got) if whole else []
        if twice or outside or missing:
            groups = sorted(r["replica_group"] for r in records)
            out.append(Violation(NAME, f"{where} (groups {groups}): units trained twice {twice}, outside the grid "
                                       f"{outside}, missing {missing}"))
    return Check(NAME, f"{len(commits)} committed steps x group ranks, each the grid of {slots} slots x {micro} "
                       "micro-batches", out)
