"""Add up chaos runs run as slices of one soak: per failure kind, over every slice, with a table and a plot.

A soak too long for one run (the 1,000-failure soak) runs as slices, one ``ftbridge-chaos`` run per seed.
``ftbridge-chaos --summarize R1 R2 ... --out DIR`` reads each slice's ``chaos.json`` (a report folder or the
file) or an earlier ``soak.json`` (its slices are taken over), and writes ``soak.json``, ``soak.txt`` and
``soak.png`` into ``DIR``. ``soak.json`` keeps, per slice, only what the sum needs (no per-failure list), so
a later summary can start from it and add new slices.

Inputs are files a user points at: each is read bounded (:data:`MAX_REPORT_BYTES`) as JSON, never
unpickled, and a slice missing a field it needs is refused naming the file and the field.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Sequence

from ftbridge.harness.chaos.invariants import Stats
from ftbridge.harness.chaos.report import save_figure, write_files

MAX_REPORT_BYTES = 64 * 1024 * 1024
_KIND_LISTS = ("survivors_s", "rejoin_s", "outage_steps_lost", "outage_pause_s")
_KIND_COUNTS = ("injected", "skipped", "survived", "discarded")
_NEEDED = ("ok", "settings", "wall_s", "final_step", "heals", "steps_discarded", "by_kind", "checks")


@dataclass(frozen=True)
class Slice:
    """One chaos run of a soak, as much of its ``chaos.json`` as the sum needs.

    Attributes:
        source: the file it was read from.
        seed, groups, nproc, spares: the run's settings.
        slots: True when it trained with slots: its settings' ``slots``, or where they lack it, a check
            "same samples as the failure-free run" among its checks.
        ok: every check held.
        checks_held, checks_run: counts of its checks.
        wall_s: seconds of failures (the failure-free run not included).
        final_step, heals, steps_discarded: the run's totals.
        loss_diff: |final val loss - failure-free val loss| in nats, or None without a failure-free run.
        recovery_bound_s: the bound its timeouts give, seconds.
        by_kind: per failure kind, the counts and lists of :func:`ftbridge.harness.chaos.report.by_kind`.
    """

    source: str
    seed: int
    groups: int
    nproc: int
    spares: int
    slots: bool
    ok: bool
    checks_held: int
    checks_run: int
    wall_s: float
    final_step: int
    heals: int
    steps_discarded: int
    loss_diff: Any
    recovery_bound_s: float
    by_kind: Dict[str, Dict[str, Any]]

    def to_json(self) -> Dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @property
    def injected(self) -> int:
        return sum(row["injected"] for row in self.by_kind.values())


def _read_json(path: str) -> Dict[str, Any]:
    size = os.path.getsize(path)
    if size > MAX_REPORT_BYTES:
        raise ValueError(f"{path}: {size} bytes, more than a chaos report's {MAX_REPORT_BYTES} limit")
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a chaos report (a JSON object was expected)")
    return data


def _slice_from_report(path: str, report: Dict[str, Any]) -> Slice:
    missing = [k for k in _NEEDED if k not in report]
    if missing:
        raise ValueError(f"{path}: not a chaos report, no {', '.join(missing)} (point at ftbridge-chaos --out)")
    s = report["settings"]
    checks = report["checks"]
    loss, base = report.get("final_val_loss"), report.get("failure_free_val_loss")
    return Slice(source=path, seed=int(s["seed"]), groups=int(s["groups"]), nproc=int(s["nproc"]),
                 spares=int(s.get("spares", 0)),
                 slots=bool(s.get("slots")) or any(c["name"] == "same samples as the failure-free run"
                                                   for c in checks),
                 ok=bool(report["ok"]), checks_held=sum(bool(c["held"]) for c in checks), checks_run=len(checks),
                 wall_s=float(report["wall_s"]), final_step=int(report["final_step"]), heals=int(report["heals"]),
                 steps_discarded=int(report["steps_discarded"]),
                 loss_diff=None if loss is None or base is None else abs(float(loss) - float(base)),
                 recovery_bound_s=float(s["recovery_bound_s"]),
                 by_kind={k: _kind_row(path, k, row) for k, row in report["by_kind"].items()})


def _kind_row(path: str, kind: str, row: Dict[str, Any]) -> Dict[str, Any]:
    try:
        out: Dict[str, Any] = {k: int(row[k]) for k in _KIND_COUNTS}
        out.update({k: [float(v) for v in row[k]] for k in _KIND_LISTS})
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: failure kind {kind!r} has no usable {e} (a report of another version?)") from e
    return out


def load(path: str) -> List[Slice]:
    """The slices in ``path``: a report folder, its ``chaos.json``, or an earlier ``soak.json``.

    Raises:
        FileNotFoundError: no ``chaos.json`` in a folder, or no such file.
        ValueError: the file is too large, not JSON, or misses a field the sum needs (the message names it).
    """
    if os.path.isdir(path):
        path = os.path.join(path, "chaos.json")
    data = _read_json(path)
    if "slices" in data:
        slices = data["slices"]
        if not isinstance(slices, list):
            raise ValueError(f"{path}: 'slices' is not a list")
        return [Slice(**{**s, "by_kind": {k: _kind_row(path, k, r) for k, r in s["by_kind"].items()}})
                for s in slices]
    return [_slice_from_report(path, data)]


@dataclass
class Soak:
    """The sum of a soak's slices.

    Attributes:
        slices: in the order given (a seed given twice is refused by :func:`add_up`).
        by_kind: per failure kind, every slice's counts added and lists joined.
    """

    slices: List[Slice]
    by_kind: Dict[str, Dict[str, Any]] = field(default_factory=dict)

    @property
    def injected(self) -> int:
        return sum(s.injected for s in self.slices)

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.slices)


def add_up(slices: Sequence[Slice]) -> Soak:
    """Add the slices' per-kind counts and join their recovery lists (pure).

    Raises:
        ValueError: no slice, or one seed twice (the same run counted twice); the message names the sources.
    """
    if not slices:
        raise ValueError("no slice to add up: give chaos report folders or a soak.json")
    seen: Dict[int, str] = {}
    for s in slices:
        if s.seed in seen:
            raise ValueError(f"seed {s.seed} twice ({seen[s.seed]} and {s.source}): a slice counts once")
        seen[s.seed] = s.source
    soak = Soak(slices=list(slices))
    for s in slices:
        for kind, row in s.by_kind.items():
            acc = soak.by_kind.setdefault(kind, {**{k: 0 for k in _KIND_COUNTS}, **{k: [] for k in _KIND_LISTS}})
            for k in _KIND_COUNTS:
                acc[k] += row[k]
            for k in _KIND_LISTS:
                acc[k] += row[k]
    return soak


def _max(values: List[float]) -> str:
    return f"{max(values):.1f}" if values else "-"


def table(soak: Soak) -> str:
    """Two text tables: the slices, then every failure kind over all of them (the longest stall is the worst
    time from an injection to the survivors' next commit)."""
    lines = [f"{'seed':>5} {'spares':>6} {'slots':>5} {'failures':>8} {'minutes':>7} {'heals':>5} "
             f"{'discarded':>9} {'final step':>10} {'loss diff':>9}  checks held"]
    for s in soak.slices:
        diff = "-" if s.loss_diff is None else f"{s.loss_diff:.1e}"
        lines.append(f"{s.seed:>5} {s.spares:>6} {'on' if s.slots else 'off':>5} {s.injected:>8} "
                     f"{s.wall_s / 60:>7.1f} {s.heals:>5} {s.steps_discarded:>9} {s.final_step:>10} {diff:>9}  "
                     f"{s.checks_held} of {s.checks_run}")
    lines.append("")
    w = max(len(k) for k in soak.by_kind)
    head = (f"{'failure kind':<{w}} {'injected':>8} {'survived':>8} {'skipped':>7} "
            f"{'survivors commit again (s)':>27} {'longest stall (s)':>17} {'rejoined (s)':>21} {'discarded':>9}")
    lines += ["min / median / max seconds after the injection", head, "-" * len(head)]
    for kind in sorted(soak.by_kind, key=lambda k: -soak.by_kind[k]["injected"]):
        row = soak.by_kind[kind]
        lines.append(f"{kind:<{w}} {row['injected']:>8} {row['survived']:>8} {row['skipped']:>7} "
                     f"{Stats(row['survivors_s']).text():>27} {_max(row['survivors_s']):>17} "
                     f"{Stats(row['rejoin_s']).text():>21} {row['discarded']:>9}")
    lines.append("-" * len(head))
    survived = sum(r["survived"] for r in soak.by_kind.values())
    minutes = sum(s.wall_s for s in soak.slices) / 60
    held = sum(s.ok for s in soak.slices)
    lines.append(f"{soak.injected} failures injected in {len(soak.slices)} slices ({minutes:.0f} minutes of "
                 f"failures), {survived} survived; {sum(s.heals for s in soak.slices)} heals, "
                 f"{sum(s.steps_discarded for s in soak.slices)} steps discarded; "
                 f"every check held in {held} of {len(soak.slices)} slices")
    for kind in sorted(soak.by_kind):
        row = soak.by_kind[kind]
        if row["outage_steps_lost"]:
            lines.append(f"{kind}: steps lost (min / median / max) {Stats(row['outage_steps_lost']).text()}, "
                         f"longest pause between commits {_max(row['outage_pause_s'])} s")
    return "\n".join(lines)


def plot(soak: Soak, path: str) -> str:
    """Failures per kind (bars, by slice) and every survivor recovery per kind (points, with each slice's
    bound as a line). Returns ``path`` (a PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = sorted(soak.by_kind, key=lambda k: soak.by_kind[k]["injected"])
    fig, (ax_n, ax_r) = plt.subplots(1, 2, figsize=(13, 0.38 * len(kinds) + 2), sharey=True,
                                     gridspec_kw={"width_ratios": [1, 2]})
    left = [0] * len(kinds)
    cmap = plt.get_cmap("tab20")
    for i, s in enumerate(soak.slices):
        counts = [s.by_kind.get(k, {}).get("injected", 0) for k in kinds]
        ax_n.barh(kinds, counts, left=left, color=cmap(i % 20), label=f"seed {s.seed}")
        left = [a + b for a, b in zip(left, counts)]
    ax_n.set_xlabel("failures injected")
    ax_n.set_title(f"{soak.injected} failures in {len(soak.slices)} slices")
    ax_n.legend(fontsize=6, ncol=2, loc="lower right")
    for y, kind in enumerate(kinds):
        row = soak.by_kind[kind]
        ax_r.plot(row["survivors_s"], [y - 0.12] * len(row["survivors_s"]), "|", color="tab:blue", ms=9)
        ax_r.plot(row["rejoin_s"], [y + 0.12] * len(row["rejoin_s"]), "|", color="tab:orange", ms=9)
    ax_r.plot([], [], "|", color="tab:blue", label="survivors commit again")
    ax_r.plot([], [], "|", color="tab:orange", label="the hit group commits again")
    bound = max(s.recovery_bound_s for s in soak.slices)
    ax_r.axvline(bound, color="red", ls="--", lw=1, label=f"survivors' bound from the timeouts ({bound:.0f} s)")
    ax_r.set_xlabel("seconds after the injection")
    ax_r.set_title(f"recoveries, {'every check held in every slice' if soak.ok else 'SOME SLICE FAILED A CHECK'}")
    ax_r.legend(fontsize=7, loc="lower right")
    return save_figure(fig, path)


def write(soak: Soak, out_dir: str) -> List[str]:
    """Write ``soak.json`` (the slices, reloadable by :func:`load`), ``soak.txt`` and ``soak.png``."""
    data = {"failures": soak.injected, "slices": [s.to_json() for s in soak.slices]}
    return write_files(out_dir, "soak", data, table(soak), lambda path: plot(soak, path))
