"""Summaries and plots of a run, read from the per-rank event logs.

:func:`summarize` gives the final state of every rank (step, validation loss,
parameter and optimizer checksums, heals) and whether every replica ended
identical; :func:`plot_run` draws loss and participants against wall time,
with heals, discarded steps and (re)starts marked.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple


@dataclass
class Summary:
    """Final state per rank, keyed by ``(replica_group, group_rank)``."""

    finals: Dict[Tuple[int, int], Dict[str, Any]]
    expected_ranks: int
    steps_committed: Dict[int, int]
    steps_discarded: Dict[int, int]
    heals: Dict[int, int]
    restarts_without_peer: set

    @property
    def identical(self) -> bool:
        """Every expected rank finished, with one parameter checksum overall and one
        optimizer checksum per group rank across replica groups."""
        if len(self.finals) != self.expected_ranks:
            return False
        if len({f["param_checksum"] for f in self.finals.values()}) != 1:
            return False
        by_rank: Dict[int, set] = {}
        for (_, r), f in self.finals.items():
            by_rank.setdefault(r, set()).add(f.get("optimizer_checksum"))
        return all(len(v) == 1 for v in by_rank.values())

    def table(self) -> str:
        """A text table of the final state of every rank."""
        head = f"{'group':>5} {'rank':>4} {'step':>5} {'val_loss':>8} {'param_checksum':>16} " \
               f"{'optim_checksum':>16} {'heals':>5}"
        lines = [head, "-" * len(head)]
        for (g, r), f in sorted(self.finals.items()):
            lines.append(f"{g:>5} {r:>4} {f['step']:>5} {f['val_loss']:>8.4f} {f['param_checksum']:>16} "
                         f"{f.get('optimizer_checksum', ''):>16} {f.get('heals', 0):>5}")
        verdict = "every rank of every replica group ends identical" if self.identical else \
            "REPLICAS DIFFER (or a rank did not finish)"
        if self.restarts_without_peer:
            verdict += (f"; replica groups {sorted(self.restarts_without_peer)} restarted with no live peer to "
                        "heal from and trained again from step 0")
        lines.append(f"{verdict}; committed steps per group {self.steps_committed}, "
                     f"discarded {self.steps_discarded}, heals {self.heals}")
        return "\n".join(lines)


def summarize(events: List[Dict[str, Any]], num_groups: int, nproc: int) -> Summary:
    """Summarise merged events of a run (see :func:`ftbridge.events.read_events`)."""
    finals: Dict[Tuple[int, int], Dict[str, Any]] = {}
    committed: Dict[int, int] = {}
    discarded: Dict[int, int] = {}
    heals: Dict[int, int] = {}
    lonely: set = set()
    for e in events:
        key = (e["replica_group"], e["group_rank"])
        if e.get("event") == "restart_without_peer":
            lonely.add(e["replica_group"])
        if e.get("event") == "final":
            finals[key] = e
        elif "event" not in e and e["group_rank"] == 0:
            g = e["replica_group"]
            committed[g] = committed.get(g, 0) + bool(e["committed"])
            discarded[g] = discarded.get(g, 0) + (not e["committed"])
            heals[g] = heals.get(g, 0) + bool(e["healed"])
    return Summary(finals, num_groups * nproc, committed, discarded, heals, lonely)


def plot_run(events: List[Dict[str, Any]], path: str, title: Optional[str] = None,
             markers: Optional[List[Tuple[float, str]]] = None) -> str:
    """Plot training loss and participants against wall time; mark heals, discards and starts.

    Args:
        events: merged event records.
        path: PNG file to write.
        markers: extra ``(time since the epoch, label)`` marks, e.g. injected failures.

    Returns:
        ``path``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [e for e in events if "event" not in e and e["group_rank"] == 0]
    if not steps:
        raise ValueError("no step events to plot: did any rank train?")
    t0 = min(e["time"] for e in events)
    groups = sorted({e["replica_group"] for e in steps})
    fig, (ax_loss, ax_part) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True,
                                           gridspec_kw={"height_ratios": [3, 1]})
    starts = [e for e in events if e.get("event") == "start" and e["group_rank"] == 0]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, g in enumerate(groups):
        mine = [e for e in steps if e["replica_group"] == g]
        # One line per launch of the group; a healing step's loss is the joiner's pre-heal loss: left out.
        cuts = sorted(e["time"] for e in starts if e["replica_group"] == g) + [float("inf")]
        for a, b in zip(cuts, cuts[1:]):
            ok = [e for e in mine if a <= e["time"] < b and e["committed"] and not e["healed"]
                  and e["loss"] is not None]
            ax_loss.plot([e["time"] - t0 for e in ok], [e["loss"] for e in ok], ".-", ms=2, lw=0.8,
                         color=colors[i % len(colors)], label=f"replica group {g}" if a == cuts[0] else None)
            # Participants as seen by this launch; the line stops at the launch's last step (no bridge
            # across the time the group was dead).
            window = [e for e in mine if a <= e["time"] < b]
            ax_part.step([e["time"] - t0 for e in window], [e["participants"] for e in window], where="post",
                         color=colors[i % len(colors)])

        for e in mine:
            if e["healed"]:
                ax_loss.axvline(e["time"] - t0, color="green", ls="--", lw=1)
                ax_loss.annotate(f"group {g} healed\n(step {e['step']})", (e["time"] - t0, ax_loss.get_ylim()[1]),
                                 fontsize=7, color="green", va="top")
            if not e["committed"]:
                ax_loss.plot(e["time"] - t0, e["loss"] or 0, "rx", ms=7)
    seen: set = set()
    for e in starts:
        g = e["replica_group"]
        label = f"group {g} restarted" if g in seen else f"group {g} started"
        seen.add(g)
        if e["time"] - t0 > 1.0:
            ax_loss.axvline(e["time"] - t0, color="red", ls=":", lw=1)
            ax_loss.annotate(label, (e["time"] - t0, 0.98), fontsize=7, color="red",
                             xycoords=("data", "axes fraction"), va="top", rotation=90)
    for when, label in markers or []:
        for ax in (ax_loss, ax_part):
            ax.axvline(when - t0, color="black", lw=1.5)
        ax_loss.annotate(label, (when - t0, 0.5), xycoords=("data", "axes fraction"), rotation=90, fontsize=8,
                         va="center", ha="right")
    ax_loss.set_ylabel("training loss")
    ax_loss.set_title(title or "ftbridge run: loss per replica group (x = discarded step)")
    ax_loss.legend(loc="upper right", fontsize=8)
    ax_part.set_ylabel("participants")
    ax_part.set_xlabel("wall time (s)")
    ax_part.set_yticks(range(0, max(e["participants"] for e in steps) + 2))
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
