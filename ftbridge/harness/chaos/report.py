"""The chaos report: JSON summary, text table and PNG plot of a :class:`~ftbridge.harness.chaos.runner.ChaosResult`."""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Dict, List

from ftbridge.harness.chaos import invariants, spares
from ftbridge.harness.chaos.invariants import Stats
from ftbridge.harness.chaos.runner import ChaosResult
from ftbridge.harness.chaos.schedule import HOSTED, LIGHTHOUSE_FAULTS, FailureKind

_COLORS = {
    FailureKind.KILL_RANK: "tab:red", FailureKind.KILL_GROUP: "darkred", FailureKind.HANG: "tab:orange",
    FailureKind.KILL_JOINER_IN_HEAL: "tab:purple", FailureKind.KILL_DONOR_IN_HEAL: "magenta",
    FailureKind.KILL_IN_CHECKPOINT: "tab:brown", FailureKind.LIGHTHOUSE_OUTAGE: "black",
    FailureKind.SCALE_DOWN: "tab:gray", FailureKind.SCALE_UP: "tab:blue",
    FailureKind.LIGHTHOUSE_HANG: "dimgray", FailureKind.LIGHTHOUSE_RESTART_EMPTY: "darkslategray",
    FailureKind.PARTITION_LIGHTHOUSE: "tab:cyan", FailureKind.PARTITION_ALL: "teal",
    FailureKind.LOSSY_LINK: "tab:olive", FailureKind.SLOW_GROUP: "gold", FailureKind.PARTITION_PEER: "tab:green",
}


def by_kind(result: ChaosResult) -> Dict[str, Dict[str, Any]]:
    """Per failure kind: injected, skipped, survived, recovery stats (s), steps discarded, heals."""
    rows: Dict[str, Dict[str, Any]] = {}
    for o in result.outcomes:
        k = o.injected.failure.kind.value
        row = rows.setdefault(k, {"injected": 0, "skipped": 0, "survived": 0, "survivors_s": [], "rejoin_s": [],
                                  "discarded": 0, "outage_steps_lost": [], "outage_pause_s": []})
        if o.injected.skipped:
            row["skipped"] += 1
            continue
        row["injected"] += 1
        row["survived"] += bool(o.recovered)
        if o.recovery:
            if o.recovery.survivors_s is not None:
                row["survivors_s"].append(o.recovery.survivors_s)
            if o.recovery.rejoin_s is not None:
                row["rejoin_s"].append(o.recovery.rejoin_s)
            row["discarded"] += o.recovery.discarded
        if o.outage is not None:
            row["outage_steps_lost"].append(o.outage.steps_lost)
            row["outage_pause_s"].append(o.outage.pause_s)
    return rows


def summary(result: ChaosResult) -> Dict[str, Any]:
    """The JSON summary of a chaos run."""
    heals = sum(1 for e in result.events if "event" not in e and e["group_rank"] == 0 and e["healed"])
    discarded = sum(1 for e in result.events if "event" not in e and e["group_rank"] == 0 and not e["committed"])
    s = result.settings
    return {
        "ok": result.ok,
        "settings": {"groups": s.groups, "nproc": s.nproc, "seed": s.seed, "script_args": list(s.script_args),
                     "cross_replica_timeout_s": s.cross_replica_timeout_s,
                     "heartbeat_timeout_ms": s.heartbeat_timeout_ms, "join_timeout_ms": s.join_timeout_ms,
                     "recovery_bound_s": s.recovery_bound_s, "loss_tolerance": s.loss_tolerance,
                     "slots_loss_tolerance": s.slots_loss_tolerance,
                     "spares": s.spares, "slots": s.slots},
        "wall_s": result.wall_s,
        "final_step": result.final_step,
        "final_val_loss": result.final_loss,
        "failure_free_val_loss": result.baseline_loss,
        "heals": heals,
        "spares_started": s.spares,
        "takeovers": len(spares.takeovers(result.events)),
        "standing_by_stopped": result.spare_pids,
        "steps_discarded": discarded,
        "orphan_commits": sorted({(e["replica_group"], e["step"]) for e in invariants.orphan_commits(result.events)}),
        "by_kind": by_kind(result),
        "failures": [o.to_json() for o in result.outcomes],
        "checks": [{"name": c.name, "held": c.held, "judged": c.judged, "violations": [str(v) for v in c.violations]}
                   for c in result.checks],
        "violations": result.violations,
        "leftover_pids": result.leftover_pids,
    }


def table(result: ChaosResult) -> str:
    """A text table: failures by kind, survived, recovery min/median/max, steps discarded, heals."""
    w = max(len(k.value) for k in FailureKind)
    head = (f"{'failure kind':<{w}} {'injected':>8} {'survived':>8} {'survivors commit again (s)':>27} "
            f"{'rejoined (s)':>21} {'discarded':>9}")
    lines = ["min / median / max seconds after the injection", head, "-" * len(head)]
    for kind, row in by_kind(result).items():
        skipped = f" ({row['skipped']} skipped)" if row["skipped"] else ""
        lines.append(f"{kind:<{w}} {row['injected']:>8} {row['survived']:>8} {Stats(row['survivors_s']).text():>27} "
                     f"{Stats(row['rejoin_s']).text():>21} {row['discarded']:>9}{skipped}")
    s = summary(result)
    lines.append("-" * len(head))
    loss = f"final val loss {result.final_loss:.4f}" if result.final_loss is not None else "no final loss"
    if result.baseline_loss is not None:
        tolerance = result.settings.loss_check[1]
        loss += (f" (failure-free {result.baseline_loss:.4f}, differs by "
                 f"{abs((result.final_loss or 0.0) - result.baseline_loss):.2g}, tolerance {tolerance:g})")
    n_skipped = sum(1 for o in result.outcomes if o.injected.skipped)
    lines.append(f"{len(result.outcomes) - n_skipped} failures injected ({n_skipped} skipped) in {result.wall_s:.0f} s "
                 f"(the failure-free run not included); {s['heals']} heals, "
                 f"{s['steps_discarded']} steps discarded, final step {result.final_step}; {loss}")
    lines.append(f"recovery bound from the timeouts: {result.settings.recovery_bound_s:.1f} s")
    if result.settings.spares:
        lines.append(f"warm spares: {result.settings.spares} started, {s['takeovers']} takeovers (spare_join), "
                     f"{len(result.spare_pids)} standing-by ranks stopped at the end")
    lines += [f"skipped: failure {o.injected.failure.index} ({o.injected.failure.kind.value}): {o.injected.skipped}"
              for o in result.outcomes if o.injected.skipped]
    rows = by_kind(result)
    for kind in sorted(LIGHTHOUSE_FAULTS | HOSTED, key=lambda k: k.value):
        outage = rows.get(kind.value)
        if outage and outage["outage_steps_lost"]:
            whose = "the job (its group that lost least)" if kind in HOSTED else "worst survivor"
            lines.append(f"{kind.value}, {whose} (min / median / max): steps lost "
                         f"{Stats(outage['outage_steps_lost']).text()}, longest pause between commits "
                         f"{Stats(outage['outage_pause_s']).text()} s")
    if s["orphan_commits"]:
        lines.append(f"orphan commits (a group committed a step the others discarded, then died before any other "
                     f"group held it; torchft commits per group): {len(s['orphan_commits'])} "
                     f"(group, step) {s['orphan_commits']}")
    lines += checks_text(result)
    return "\n".join(lines)


def checks_text(result: ChaosResult) -> List[str]:
    """The verdict and every check that ran, with its outcome; checks that did not run are named as such."""
    held = sum(c.held for c in result.checks)
    lines = [f"{'OK' if result.ok else 'FAILED'}: {held} of {len(result.checks)} checks held"]
    for c in result.checks:
        lines.append(f"  {'held  ' if c.held else 'BROKEN'} {c.name} ({c.judged})")
        lines += [f"         - {v}" for v in c.violations]
    listed = {str(v) for c in result.checks for v in c.violations}
    lines += [f"  BROKEN {v}" for v in result.violations if v not in listed]  # never hide one
    if not {"final loss within tolerance", "same model as the failure-free run"} & {c.name for c in result.checks}:
        lines.append("  not run: final loss against a failure-free run (--no-baseline)")
    return lines


def plot(result: ChaosResult, path: str) -> str:
    """Loss against wall time and against step, participants over time; failures and heals marked.

    Returns:
        ``path`` (a PNG).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [e for e in result.events if "event" not in e and e["group_rank"] == 0]
    if not steps:
        raise ValueError("no step events to plot: did any rank train?")
    t0 = min(e["time"] for e in steps)
    fig, (ax_t, ax_p, ax_s) = plt.subplots(3, 1, figsize=(11, 9), gridspec_kw={"height_ratios": [3, 1, 2]})
    groups = sorted({e["replica_group"] for e in steps})
    for g in groups:
        ok = [e for e in steps if e["replica_group"] == g and e["committed"] and not e["healed"] and e["loss"]]
        ax_t.plot([e["time"] - t0 for e in ok], [e["loss"] for e in ok], ".", ms=1.5, label=f"replica group {g}")
        ax_s.plot([e["step"] for e in ok], [e["loss"] for e in ok], ".", ms=1.5, label=f"replica group {g}")
        mine = [e for e in steps if e["replica_group"] == g]
        ax_p.step([e["time"] - t0 for e in mine], [e["participants"] for e in mine], where="post", lw=0.8)
        for e in mine:
            if e["healed"]:
                for ax in (ax_t, ax_p):
                    ax.axvline(e["time"] - t0, color="green", ls="--", lw=0.8)
    bad = [e for e in steps if not e["committed"]]
    ax_t.plot([e["time"] - t0 for e in bad], [e["loss"] or 0 for e in bad], "kx", ms=5, label="discarded step")
    seen = set()
    for o in result.outcomes:
        if o.injected.skipped:
            continue
        kind = o.injected.failure.kind
        label = kind.value if kind not in seen else None
        seen.add(kind)
        for ax in (ax_t, ax_p):
            if o.injected.ended is not None:  # a failure that lasts: shade it
                ax.axvspan(o.injected.time - t0, o.injected.ended - t0, color=_COLORS[kind], alpha=0.15,
                           label=label if ax is ax_t else None)
            else:
                ax.axvline(o.injected.time - t0, color=_COLORS[kind], lw=1.6, label=label if ax is ax_t else None)
    for e in spares.takeovers(result.events):
        ax_p.axvline(e["time"] - t0, color="tab:cyan", ls=":", lw=1.2)
    ax_t.plot([], [], color="green", ls="--", label="heal")
    if spares.takeovers(result.events):
        ax_t.plot([], [], color="tab:cyan", ls=":", label="spare takeover (participants panel)")
    ax_t.set_ylabel("training loss")
    ax_t.set_xlabel("wall time (s)")
    verdict = (f"all {len(result.checks)} checks held" if result.ok
               else f"FAILED: {len(result.violations)} violations")
    ax_t.set_title(f"chaos run: {len([o for o in result.outcomes if not o.injected.skipped])} failures, "
                   f"{len(groups)} replica groups x {result.settings.nproc} ranks - {verdict}")
    ax_t.legend(loc="upper right", fontsize=7, ncol=2)
    ax_p.set_ylabel("participants")
    ax_p.set_xlabel("wall time (s)")
    ax_p.set_yticks(range(0, result.settings.groups + 1))
    ax_s.set_ylabel("training loss")
    ax_s.set_xlabel("step")
    return save_figure(fig, path)


def save_figure(fig: Any, path: str) -> str:
    """Lay out, save as ``path`` (PNG, its folder made) and close a matplotlib figure; returns ``path``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_files(out_dir: str, stem: str, data: Dict[str, Any], text: str, draw: Callable[[str], str]) -> List[str]:
    """Write ``STEM.json`` (``data``), ``STEM.txt`` (``text``) and ``STEM.png`` (``draw(path)``) into ``out_dir``
    (made if missing); return their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, f"{stem}.{ext}") for ext in ("json", "txt", "png")]
    with open(paths[0], "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    with open(paths[1], "w", encoding="utf-8") as f:
        f.write(text + "\n")
    draw(paths[2])
    return paths


def write(result: ChaosResult, out_dir: str) -> List[str]:
    """Write ``chaos.json``, ``chaos.txt`` and ``chaos.png`` into ``out_dir``; return their paths."""
    return write_files(out_dir, "chaos", summary(result), table(result), lambda path: plot(result, path))
