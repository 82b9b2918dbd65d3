"""``ftbridge-bench``: run the benchmark suite and write its report.

Runs the benchmarks registered by the modules of
:data:`ftbridge.harness.bench.core.MODULES` in that order, each against a baseline
measured in the same invocation, and writes ``bench.json``, ``bench.md`` and
PNG plots to ``--out`` (:mod:`ftbridge.harness.bench.report`). Run logs, event logs
and result files of every training run go to ``OUT/work`` (emptied first).
A benchmark that raises is recorded as failed, with its error, and the
others still run. Exit code: 0 all ran, 1 a benchmark failed, 2 bad arguments,
130 interrupted (Ctrl-C or SIGTERM: running jobs are stopped and the partial
report is written)::

    ftbridge-bench                                  # everything, 3 repetitions (tens of minutes here)
    ftbridge-bench --quick --out runs/bench-quick   # CI smoke: 1 repetition, few steps, small models
    ftbridge-bench --only overhead,overlap --reps 5 --steps 100

``--quick`` sets 1 repetition, 6 timed steps after 3 warm-up steps and a
300 s job timeout; explicit ``--reps``/``--steps``/``--warmup-steps``/``--timeout-s``
override it. The ftbridge jobs train with slots unless ``--slots off`` (``FTBRIDGE_SLOTS=0``), as the
main job does. See ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import shutil
import signal
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

from ftbridge.harness.bench import core
from ftbridge.harness.bench.report import failure, write_report
from ftbridge.launch.build_lock import prepare_jit_build
from ftbridge.launch.cli_types import ArgumentParser, at_least, finite

QUICK = {"reps": 1, "steps": 6, "warmup_steps": 3, "timeout_s": 300.0}
"""Settings of ``--quick`` unless given explicitly."""

log = logging.getLogger("ftbridge.harness.bench")


def load_benchmarks() -> List[str]:
    """Import every module of ``core.MODULES`` (each registers itself); the registered names in ``MODULES`` order.

    The order is the modules', not the registry's: a module imported earlier
    elsewhere (a test, a script) registers first.
    """
    for module in core.MODULES:
        importlib.import_module(module)
    rank = {module: i for i, module in enumerate(core.MODULES)}
    return sorted(core.REGISTRY, key=lambda name: rank.get(core.REGISTRY[name].__module__, len(rank)))


def select(only: Optional[str], available: Sequence[str]) -> List[str]:
    """The benchmarks to run: all of ``available``, or the comma-separated names in ``only`` (their order).

    Raises:
        ValueError: a name is not registered (the message names it and lists the valid names), or
            ``only`` names none.
    """
    if only is None:
        return list(available)
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in available]
    if unknown:
        raise ValueError(f"unknown benchmark(s) {', '.join(unknown)}: choose from {', '.join(available)}")
    if not names:
        raise ValueError(f"--only {only!r} names no benchmark: choose from {', '.join(available)}")
    return list(dict.fromkeys(names))


def build_parser() -> argparse.ArgumentParser:
    """Flags of ``ftbridge-bench``."""
    p = ArgumentParser(prog="ftbridge-bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="CI smoke run: 1 repetition, few steps, small models")
    p.add_argument("--only", metavar="NAME[,NAME]", default=None, help="run only these benchmarks, in this order")
    p.add_argument("--out", default=os.path.join("runs", "bench"), help="report folder (default runs/bench)")
    p.add_argument("--reps", type=at_least(1), default=None, help="repetitions per configuration (default 3; quick 1)")
    p.add_argument("--steps", type=at_least(1), default=None,
                   help="timed training steps per steady-state run, after warm-up (default 60; quick 6)")
    p.add_argument("--warmup-steps", type=at_least(0), default=None,
                   help="leading steps left out of every step-time median (default 10; quick 3)")
    p.add_argument("--timeout-s", type=finite(0.0, strictly_above=True), default=None,
                   help="wall-clock limit of any one training job, seconds (default 600; quick 300)")
    p.add_argument("--slots", choices=("on", "off"), default="on",
                   help="train the ftbridge jobs with slots, one per planned replica group, as scripts/train_lm.py "
                        "does by default (on), or with FTBRIDGE_SLOTS=0 (off); default on")
    p.add_argument("--list", action="store_true", help="print the benchmark names and exit")
    return p


def parse(argv: Optional[Sequence[str]] = None) -> Tuple[argparse.Namespace, core.BenchSettings, List[str]]:
    """Parse and validate the command line before any work starts.

    Returns:
        ``(args, settings, benchmark names to run)``.

    Raises:
        SystemExit: (status 2, with the usage) an unknown ``--only`` name or a bad setting.
    """
    p = build_parser()
    args = p.parse_args(argv)
    available = load_benchmarks()
    try:
        names = select(args.only, available)
        given = {k: getattr(args, k) for k in QUICK if getattr(args, k) is not None}
        settings = core.BenchSettings(workdir=os.path.abspath(os.path.join(args.out, "work")), quick=args.quick,
                                      slots=args.slots == "on", **{**(QUICK if args.quick else {}), **given})
        if settings.timeout_s <= 0:
            raise ValueError(f"--timeout-s {settings.timeout_s}: must be > 0 seconds")
        blocked = _first_file_on_the_way(args.out)
        if blocked:
            raise ValueError(f"--out {args.out}: {blocked} is a file, not a folder; give a folder path")
    except ValueError as exc:
        p.error(str(exc))
    return args, settings, names


def _first_file_on_the_way(path: str) -> str:
    """The first existing non-folder among ``path`` and its parents ("" when the folder can be made there)."""
    here = os.path.abspath(path)
    while True:
        if os.path.exists(here) and not os.path.isdir(here):
            return here
        parent = os.path.dirname(here)
        if parent == here:
            return ""
        here = parent


def run_all(settings: core.BenchSettings, names: Sequence[str]
            ) -> Tuple[List[core.Metric], List[Dict[str, object]], Dict[str, float]]:
    """Run ``names`` in order with a progress bar; a benchmark's exception becomes a failure entry.

    Returns:
        ``(metrics, failures, wall seconds per benchmark)``. A ``KeyboardInterrupt``
        stops the run: the interrupted benchmark is recorded as failed and the rest skipped.
    """
    from tqdm import tqdm

    metrics: List[core.Metric] = []
    failures: List[Dict[str, object]] = []
    durations: Dict[str, float] = {}
    bar = tqdm(names, unit="benchmark", desc="ftbridge-bench", disable=not sys.stderr.isatty())
    for name in bar:
        bar.set_postfix_str(name)
        log.info("== %s ==", name)
        t0 = time.monotonic()
        try:
            got = core.REGISTRY[name](settings)
            metrics += got
            durations[name] = time.monotonic() - t0
            for m in got:
                verdict = "" if m.met is None else (" met" if m.met else " NOT met")
                log.info("%s: %s = %.4g %s (target %s)%s", name, m.name, m.value, m.unit, m.target or "none", verdict)
            log.info("%s done in %.1f s", name, durations[name])
        except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - one failure must not lose the others
            durations[name] = time.monotonic() - t0
            failures.append(failure(name, exc, durations[name]))
            lines = str(exc).splitlines()
            log.error("%s FAILED after %.1f s: %s: %s", name, durations[name], type(exc).__name__,
                      lines[0] if lines else "")
            if len(lines) > 1:  # the failed job's log tail: what CI shows of a failure
                log.error("%s: the rest of the error:\n%s", name, "\n".join("    " + x for x in lines[1:41]))
            if isinstance(exc, KeyboardInterrupt):
                break
    bar.close()
    return metrics, failures, durations


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _setup_logging() -> None:
    from tqdm import tqdm

    if any(getattr(h, "ftbridge_bench", False) for h in log.handlers):
        return

    class TqdmHandler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            tqdm.write(self.format(record), file=sys.stderr)

    handler = TqdmHandler()
    handler.ftbridge_bench = True  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter("[bench %(asctime)s] %(message)s", "%H:%M:%S"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``ftbridge-bench``; returns the exit status (0 all ran, 1 a benchmark failed, 130 interrupted)."""
    args, settings, names = parse(argv)
    if args.list:
        print("\n".join(load_benchmarks()))
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # two processes on two cores stall for seconds otherwise
    prepare_jit_build()
    # SIGTERM (a CI or `timeout` limit) ends the run like Ctrl-C: jobs stopped, the partial report written.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        with core.slots_environment(settings):
            return _run(args, settings, names)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace, settings: core.BenchSettings, names: Sequence[str]) -> int:
    _setup_logging()
    shutil.rmtree(settings.workdir, ignore_errors=True)
    os.makedirs(settings.workdir)
    log.info("running %s (%s, slots %s), report in %s", ", ".join(names), "quick" if settings.quick else "full",
             "on" if settings.slots else "off", os.path.abspath(args.out))
    t0 = time.monotonic()
    metrics, failures, durations = run_all(settings, names)
    record = write_report(args.out, settings, metrics, failures, durations)
    log.info("%d metric(s), %d failure(s) in %.1f s; wrote %s", len(metrics), len(failures), time.monotonic() - t0,
             ", ".join(record["files"]))
    for name, err in record["plot_errors"].items():
        log.error("plot %s failed: %s", name, err)
    return 130 if any(str(f["error"]).startswith("KeyboardInterrupt") for f in failures) else 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
