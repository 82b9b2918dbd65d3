"""The verdict on a finished chaos run: the checks that read the whole run's records and logs.

:func:`end_checks` (the job's end state, coverage of the grid with slots, checkpoints, every failure
recovered from within the bound, no spinning rank) and :func:`death_checks` (no rank died that no
failure aimed at, none lived on without committing) turn a stopped run into
:class:`~ftbridge.harness.chaos.invariants.Check` s for the report; :func:`final_loss` is the value the
failure-free baseline is compared with. Pure readers of records and files: no process is touched.
"""

from __future__ import annotations

import glob
import math
import os
import statistics
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

from ftbridge.harness.chaos import coverage, deaths, invariants

if TYPE_CHECKING:
    from ftbridge.harness.chaos.runner import ChaosSettings, Outcome
    from ftbridge.harness.local_job import LocalJob


def final_loss(events: Sequence[Dict[str, Any]]) -> Optional[float]:
    """Mean final validation loss over the ranks' ``final`` records at the job's last step (``None`` without one);
    a group that left earlier (a scale-down, a rank stopped between failures) wrote its own at a lower step."""
    finals = [e for e in events if e.get("event") == "final" and e.get("val_loss") is not None]
    if not finals:
        return None
    last = max(e["step"] for e in finals)
    return statistics.fmean(e["val_loss"] for e in finals if e["step"] == last)


def _saved_params(folder: str) -> Dict[str, int]:
    """``{path: step}`` of the parameter files in ``folder`` (``train_lm.py --save-params``), unreadable ones
    at step -1."""
    from safetensors import SafetensorError, safe_open

    out = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.st"))):
        try:
            with safe_open(path, framework="pt") as f:
                out[path] = int((f.metadata() or {}).get("global_steps", -1))
        except (OSError, ValueError, SafetensorError):  # a group killed while writing: the caller finds it missing
            out[path] = -1
    return out


def param_distance(path: str, reference: str) -> Dict[str, float]:
    """``relative`` (||p - r|| / ||r||, every parameter as one vector) and ``max_abs`` (max |p - r|) between
    two parameter files.

    Raises:
        ValueError: their parameter names or shapes differ.
    """
    from safetensors.torch import load_file

    p, r = load_file(path), load_file(reference)
    if p.keys() != r.keys() or any(p[k].shape != r[k].shape for k in r):
        raise ValueError(f"{path} and {reference} hold different parameters (names or shapes)")
    diff_sq = sum(float((p[k].double() - r[k].double()).square().sum()) for k in r)
    ref_sq = sum(float(r[k].double().square().sum()) for k in r)
    max_abs = max((float((p[k] - r[k]).abs().max()) for k in r if r[k].numel()), default=0.0)
    return {"relative": math.sqrt(diff_sq) / max(math.sqrt(ref_sq), 1e-30), "max_abs": max_abs}


def same_parameters(chaos_dir: str, baseline_dir: str, final_step: int, tolerance: float) -> invariants.Check:
    """Every group's final parameters at ``final_step`` are within ``tolerance`` (relative L2) of the
    failure-free run's at that step: with slots both trained one model up to the order of floating-point sums.

    A file at another step is a group that left earlier (a scale-down) and is not compared; no file at
    ``final_step`` on either side is a violation.
    """
    name, V = "same parameters as the failure-free run", invariants.Violation
    ours = [p for p, step in _saved_params(chaos_dir).items() if step == final_step]
    theirs = [p for p, step in _saved_params(baseline_dir).items() if step == final_step]
    if not ours or not theirs:
        return invariants.Check(name, f"parameter files at step {final_step}", [V(name, (
            f"no parameters saved at step {final_step}: {len(ours)} from the chaos run ({chaos_dir}), "
            f"{len(theirs)} from the failure-free run ({baseline_dir})"))])
    violations, worst = [], {"relative": 0.0, "max_abs": 0.0}
    for path in ours:
        try:
            d = param_distance(path, theirs[0])
        except ValueError as e:
            violations.append(V(name, str(e)))
            continue
        worst = {k: max(worst[k], d[k]) for k in worst}
        if not d["relative"] <= tolerance:  # NaN fails too
            violations.append(V(name, f"{os.path.basename(path)}: ||p - p_failure_free|| / ||p_failure_free|| = "
                                      f"{d['relative']:.2e}, more than {tolerance:g} (max |diff| {d['max_abs']:.2e})"))
    return invariants.Check(name, f"{len(ours)} groups at step {final_step}: relative L2 {worst['relative']:.1e}, "
                                  f"max |diff| {worst['max_abs']:.1e}, tolerance {tolerance:g}", violations)


def end_checks(settings: "ChaosSettings", events: Sequence[Dict[str, Any]], outcomes: Sequence["Outcome"],
               alive: Sequence[int], final_step: int, started: int, leftover: Sequence[int],
               ckpt_dir: Optional[str]) -> List[invariants.Check]:
    """The checks run once the job has stopped (the final loss is added by the caller when it runs)."""
    V = invariants.Violation
    checks = invariants.log_checks(events)
    checks.append(invariants.Check(
        "identical end", f"final records of groups {list(alive)} x {settings.nproc} ranks at step {final_step}",
        [V("identical end", m) for m in final_state_violations(events, alive, settings.nproc, final_step)]))
    checks.append(invariants.Check("no process left", f"{started} PIDs started",
                                   [V("no process left", f"processes left behind: pids {leftover}")] if leftover
                                   else []))
    if settings.slots:
        checks.append(coverage.same_samples(events, settings.slots, grad_accum(settings.script_args)))
    if ckpt_dir is not None:
        checks.append(invariants.Check("checkpoints valid", ckpt_dir,
                                       [V("checkpoints valid", m) for m in checkpoints_valid(ckpt_dir)]))
    injected = [o for o in outcomes if not o.injected.skipped]
    checks.append(invariants.Check(
        "recovered from every failure", f"{len(injected)} failures injected",
        [V("recovery", f"failure {o.injected.failure.index} ({o.injected.failure.kind.value}) not recovered from")
         for o in injected if not o.recovered]))
    checks.append(invariants.Check(
        "no rank spins", f"{len(injected)} failure windows, at most {invariants.SPIN_CPU_SHARE:g} of a core "
                         "for a rank that does not step",
        [V("no rank spins", f"failure {o.injected.failure.index} ({o.injected.failure.kind.value}): {s}")
         for o in injected for s in o.spins]))
    timed = [(o, o.recovery.survivors_s) for o in injected
             if o.recovery is not None and o.recovery.survivors_s is not None]
    checks.append(invariants.Check(
        "recovery within the bound", f"{len(timed)} survivor recoveries against {settings.recovery_bound_s:.1f} s",
        [V("recovery bound", f"failure {o.injected.failure.index} ({o.injected.failure.kind.value}): survivors "
                             f"took {s:.1f} s to commit again, above the bound "
                             f"{settings.recovery_bound_s:.1f} s")
         for o, s in timed if s > settings.recovery_bound_s]))
    return checks


def death_checks(settings: "ChaosSettings", job: "LocalJob", events: Sequence[Dict[str, Any]],
                 outcomes: Sequence["Outcome"], until: float) -> List[invariants.Check]:
    """No rank died before ``until`` (the run's own stop) unless a failure aimed at its group
    (:mod:`ftbridge.harness.chaos.deaths`), and none lived on past its quorum timeout without committing
    (:func:`invariants.silent_ranks`)."""
    launches = [*(gp for ls in job.groups.values() for gp in ls), *job.spares.values()]
    logs = {}
    for gp in launches:
        with open(gp.log_path, encoding="utf-8", errors="replace") as f:
            logs[gp.log_path] = f.read()
    hits = [(o.began, o.done, [*o.injected.hit, *o.injected.rejoin]) for o in outcomes
            if o.began is not None and o.done is not None and not o.injected.skipped]
    year = time.localtime().tm_year
    died = {d.pid: d.time for text in logs.values() for d in deaths.deaths_in_log(text, year)}
    collateral = deaths.collateral_in_logs(logs, events, hits, year, until)
    bound = settings.silence_bound_s
    return [invariants.Check("no collateral death", f"{len(died)} rank deaths in {len(logs)} launcher logs",
                             [invariants.Violation("no collateral death", m) for m in collateral]),
            invariants.Check("no rank lives on without committing",
                             f"longest time without a commit of every rank that committed, against {bound:.1f} s",
                             invariants.silent_ranks(events, died, bound))]


def final_state_violations(events: Sequence[Dict[str, Any]], alive: Sequence[int], nproc: int,
                           final_step: int) -> List[str]:
    """Why the active groups' final records do not show one finished job (empty when they do)."""
    # A group that left (scale-down: SIGTERM, a graceful stop) wrote a final record then; if it joined
    # again, only its last launch's record counts.
    last: Dict[Any, Dict[str, Any]] = {}
    for e in sorted((e for e in events if e.get("event") == "final" and e["replica_group"] in alive),
                    key=lambda e: e["time"]):
        last[(e["replica_group"], e["group_rank"])] = e
    finals = list(last.values())
    out = []
    if len(finals) != len(alive) * nproc:
        out.append(f"{len(finals)} of {len(alive) * nproc} ranks of groups {list(alive)} wrote a final record")
    if {f["step"] for f in finals} - {final_step}:
        out.append(f"final steps {sorted({f['step'] for f in finals})}, expected {final_step}")
    if len({f["param_checksum"] for f in finals}) > 1:
        out.append("replicas end with different parameters")
    for r in range(nproc):
        if len({f.get("optimizer_checksum") for f in finals if f["group_rank"] == r}) > 1:
            out.append(f"group rank {r} ends with different optimizer state across replica groups")
    return out


def checkpoints_valid(ckpt_dir: str) -> List[str]:
    """Every published checkpoint matches its manifest, and ``latest`` names a valid one."""
    from ftbridge.checkpoint import manifest as mf
    from ftbridge.checkpoint.store import CheckpointStore

    published = CheckpointStore(ckpt_dir).list()
    if not published:
        return [f"no checkpoint was published in {ckpt_dir}"]
    out = [f"checkpoint {c.tag}: {'; '.join(bad)}" for c in published if (bad := c.problems())]
    latest = mf.read_latest(ckpt_dir)
    if latest is None or latest not in {c.tag for c in published}:
        out.append(f"'latest' in {ckpt_dir} names {latest!r}, which is not a published checkpoint")
    return out


def grad_accum(script_args: Sequence[str]) -> int:
    """The main job's ``--grad-accum`` in its flags (the last one given; 1 when none)."""
    args = list(script_args)
    given = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--grad-accum"]
    return int(given[-1]) if given else 1
