"""``ftbridge-lighthouse status``'s output: a lighthouse's state as a table or JSON.

The state is read by :func:`ftbridge.manager.lighthouse_status.fetch_status`, which defines the fields.

Example::

    print(format_table(fetch_status("http://127.0.0.1:29510")))
"""

from __future__ import annotations

import json
from typing import Optional

from ftbridge.manager.lighthouse_status import LighthouseStatus


def _fmt_age(age: Optional[float]) -> str:
    return "-" if age is None else f"{age:.1f}s"


def format_table(status: LighthouseStatus) -> str:
    """The status as a plain-text table, one line per quorum member (columns: ``docs/lighthouse.md``, "Status")."""
    head = [f"quorum_id {status.quorum_id}"]
    if status.previous_quorum_id is not None:
        head.append(f"last quorum {status.previous_quorum_id} issued {_fmt_age(status.quorum_age_s)} ago "
                    f"with {len(status.members)} member(s)")
    else:
        head.append("no quorum issued yet")
    lines = ["; ".join(head), f"next quorum: {status.next_quorum}"]
    rows = [("group", "replica_id", "step", "group_size", "manager", "heartbeat", "state")]
    for m in sorted(status.members, key=lambda m: m.replica_id):
        rows.append((str(m.replica_group) if m.replica_group is not None else "-", m.replica_id, str(m.step),
                     str(m.world_size), m.manager_address, _fmt_age(m.heartbeat_age_s),
                     "recovering" if m.recovering else "ok"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    others = [h for h in status.heartbeats if h.replica_id not in {m.replica_id for m in status.members}]
    for h in sorted(others, key=lambda h: h.replica_id):
        lines.append(f"heartbeating, not in the last quorum: {h.replica_id} "
                     f"(seen {_fmt_age(h.age_s)} ago{', stale' if h.stale else ''})")
    return "\n".join(lines)


def format_json(status: LighthouseStatus) -> str:
    """The status as indented JSON (see :meth:`LighthouseStatus.to_json`)."""
    return json.dumps(status.to_json(), indent=2, sort_keys=True)
