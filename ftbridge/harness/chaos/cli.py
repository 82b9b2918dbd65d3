"""``ftbridge-chaos``: run the main training job under injected failures and check it survived.

Examples::

    # CI-sized: each failure kind once, 3 groups x 2 ranks, tiny model (about 3-4 minutes)
    ftbridge-chaos --quick --out chaos-report

    # soak: 30 minutes, a failure every 15 s on average
    ftbridge-chaos --soak-minutes 30 --mtbf 15 --out soak-report

    # with a warm spare standing by (it takes over the first group the lighthouse drops)
    ftbridge-chaos --quick --spares 1 --count 12 --out spare-report

    # add up a soak run in slices (report folders or an earlier soak.json): soak.txt, soak.png
    ftbridge-chaos --summarize r1 r2 r3 --out soak-report

Exit status: 0 when every invariant held, 1 otherwise, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import tempfile
from typing import List, Optional

from ftbridge.launch.build_lock import prepare_jit_build
from ftbridge.launch.cli_types import ArgumentParser, at_least, finite

POSITIVE = finite(0.0, strictly_above=True)

TINY = ["--n-layer", "2", "--d-model", "64", "--n-head", "4", "--context", "32", "--micro-batch", "4",
        "--val-every", "0", "--val-batches", "8", "--warmup-steps", "2"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``ftbridge-chaos`` (values checked across flags by :func:`parse_args`)."""
    from ftbridge.harness.chaos.schedule import FailureKind

    p = ArgumentParser(prog="ftbridge-chaos", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", type=int, default=3, help="planned replica groups (default 3)")
    p.add_argument("--nproc-per-node", "--nproc", dest="nproc", type=int, default=2,
                   help="ranks per replica group, as ftbridge-run's flag (default 2; --nproc is the old spelling)")
    p.add_argument("--kinds", default="all",
                   help=f"comma-separated failure kinds or 'all': {', '.join(k.value for k in FailureKind)}")
    p.add_argument("--seed", type=int, default=0, help="seeds the schedule and the targets")
    p.add_argument("--count", type=at_least(1), default=None,
                   help="number of failures, at least 1 (default: each kind once)")
    p.add_argument("--soak-minutes", type=POSITIVE, default=None, help="inject failures for this long (soak run)")
    p.add_argument("--mtbf", type=POSITIVE, default=10.0, help="mean time between failures, seconds (default 10)")
    p.add_argument("--hang-s", type=POSITIVE, default=None,
                   help="how long a hang or a slowed group lasts (default: cross-replica timeout + 3 s)")
    p.add_argument("--outage-s", type=POSITIVE, default=10.0,
                   help="how long a lighthouse outage or hang, or a partition or lossy link lasts (default 10)")
    p.add_argument("--cross-replica-timeout-s", "--cross-replica-timeout", dest="cross_replica_timeout",
                   type=POSITIVE, default=5.0,
                   help="seconds, as ftbridge-run's flag (default 5; --cross-replica-timeout is the old spelling)")
    p.add_argument("--zero-stage", type=int, choices=(1, 2, 3), default=2)
    p.add_argument("--spares", type=at_least(0), default=0, metavar="COUNT",
                   help="warm spares (ftbridge-run --spare-index k, k < K) started once the job runs, 0..--groups "
                        "(default 0); scale_down is then skipped (a spare would take the leaving group's id)")
    p.add_argument("--slots", type=at_least(0), default=None, metavar="N",
                   help="train with slots (FTBRIDGE_SLOTS=N, at least --groups; default: --groups; 0: off) and "
                        "check that every committed step trained the whole grid of slots once and that the job "
                        "ends with the failure-free run's model")
    p.add_argument("--quick", action="store_true", help="tiny model (CI smoke run)")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the failure-free run (and the final-loss check)")
    p.add_argument("--loss-tolerance", type=finite(0.0), default=0.15,
                   help="largest |final val loss - failure-free val loss|, nats, slots off (default 0.15)")
    p.add_argument("--slots-loss-tolerance", type=finite(0.0), default=1e-3,
                   help="the same with --slots, where both runs train one model up to the order of floating-point "
                        "sums (default 0.001)")
    p.add_argument("--slots-param-tolerance", type=finite(0.0), default=1e-2,
                   help="with --slots, the largest ||p - p_failure_free|| / ||p_failure_free|| of the final "
                        "parameters of every group (default 0.01)")
    p.add_argument("--out", default="chaos-report", help="report folder (default ./chaos-report)")
    p.add_argument("--summarize", nargs="+", metavar="REPORT", default=None,
                   help="run nothing: add up these chaos reports (--out folders, or an earlier soak.json) as the "
                        "slices of one soak and write soak.json, soak.txt and soak.png into --out")
    p.add_argument("--workdir", default=None, help="logs and event logs (default: a temporary folder)")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="after '--': more scripts/train_lm.py arguments")
    return p


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The checked arguments of ``ftbridge-chaos`` (exit 2 with a message naming the flag on a bad value)."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.summarize:
        return args  # runs nothing: the run's flags are not read
    if args.groups < 2:
        p.error(f"--groups {args.groups}: a chaos run needs at least 2 replica groups (one must survive)")
    if args.nproc < 1:
        p.error(f"--nproc-per-node {args.nproc}: must be at least 1")
    if args.slots is None:
        args.slots = args.groups
    if 0 < args.slots < args.groups:
        p.error(f"--slots {args.slots} is fewer than --groups {args.groups}: each group needs a slot of its own")
    from ftbridge.harness.chaos.spares import validate_spares

    try:
        validate_spares(args.spares, args.groups)
    except ValueError as e:
        p.error(str(e))
    from ftbridge.harness.chaos.schedule import parse_kinds

    try:
        args.kind_list = parse_kinds(args.kinds)
    except ValueError as e:
        p.error(f"--kinds {args.kinds!r}: {e}")
    from ftbridge.harness.chaos.runner import check_hosted

    try:
        check_hosted(set(args.kind_list), args.spares)
    except ValueError as e:
        if args.kinds.strip() != "all":
            p.error(f"--kinds {args.kinds!r}: {e}")
        from ftbridge.harness.chaos.schedule import HOSTED

        args.kind_list = [k for k in args.kind_list if k not in HOSTED]
        print(f"ftbridge-chaos: 'all' leaves out {', '.join(sorted(k.value for k in HOSTED))}: {e}", file=sys.stderr)
    return args


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def summarize(reports: List[str], out_dir: str) -> int:
    """``--summarize``: add up the slices in ``reports`` into ``out_dir``; 0 when every slice held, 1 when
    one did not, 2 when a report cannot be read (the message names it)."""
    from ftbridge.harness.chaos import soak

    try:
        total = soak.add_up([s for path in reports for s in soak.load(path)])
    except (OSError, ValueError) as e:
        print(f"ftbridge-chaos: --summarize: {e}", file=sys.stderr)
        return 2
    paths = soak.write(total, out_dir)
    print(soak.table(total))
    print(f"report: {', '.join(paths)}")
    return 0 if total.ok else 1


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.summarize:
        return summarize(args.summarize, args.out)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    os.environ.setdefault("RUST_LOG", "warn")
    prepare_jit_build()
    from tqdm import tqdm

    from ftbridge.harness.chaos import report
    from ftbridge.harness.chaos.runner import ChaosSettings, run_chaos
    from ftbridge.harness.chaos.schedule import make_schedule

    try:
        hang_s = args.hang_s if args.hang_s is not None else args.cross_replica_timeout + 3.0
        schedule = make_schedule(seed=args.seed, kinds=args.kind_list, num_groups=args.groups, count=args.count,
                                 duration_s=None if args.soak_minutes is None else args.soak_minutes * 60,
                                 mtbf_s=args.mtbf, hang_s=hang_s, outage_s=args.outage_s)
    except ValueError as e:
        print(f"ftbridge-chaos: {e}", file=sys.stderr)
        return 2
    extra = [a for a in args.train_args if a != "--"]
    script_args = [*(TINY if args.quick else []), "--zero-stage", str(args.zero_stage), *extra]
    workdir = args.workdir or tempfile.mkdtemp(prefix="ftbridge-chaos-")
    settings = ChaosSettings(workdir=workdir, groups=args.groups, nproc=args.nproc, script_args=script_args,
                             seed=args.seed, cross_replica_timeout_s=args.cross_replica_timeout,
                             baseline=not args.no_baseline, loss_tolerance=args.loss_tolerance, spares=args.spares,
                             slots=args.slots, slots_loss_tolerance=args.slots_loss_tolerance,
                             slots_param_tolerance=args.slots_param_tolerance)
    print(f"ftbridge-chaos: {len(schedule)} failures ({', '.join(f.kind.value for f in schedule)}), "
          f"{args.groups} replica groups x {args.nproc} ranks, {args.spares} warm spare(s), logs in {workdir}",
          flush=True)
    # SIGTERM (a CI or `timeout` limit) ends the run like Ctrl-C: run_chaos's clean-up stops every
    # process it started (without this, the groups outlived the runner and torchrun restarted them).
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        with tqdm(total=len(schedule), unit="failure", desc="chaos") as bar:
            result = run_chaos(settings, schedule, progress=bar)
    except KeyboardInterrupt:
        print("ftbridge-chaos: interrupted; every process it started has been stopped", file=sys.stderr)
        return 130
    paths = report.write(result, args.out)
    print(report.table(result))
    print(f"report: {', '.join(paths)}")
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
