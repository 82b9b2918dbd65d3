"""The main job, end to end on one machine: train, kill a replica group, replace it, heal, finish.

Starts torchft's lighthouse, launches 2 replica groups of 2 ranks (each its
own ``ftbridge-run`` / torchrun, DeepSpeed ZeRO inside the group) training a
character-level GPT on Shakespeare, plus one warm spare group
(``ftbridge-run --spare-index 0``: initialised, outside the quorum). It SIGKILLs
every rank of group 1 partway; the spare takes group 1's place as soon as
the lighthouse drops it, heals from group 0 and trains on. With
``--no-spare``, torchrun restarts group 1 instead (a cold start). At the end
it prints the validation loss and every rank's parameter checksum::

    python scripts/demo.py                      # 2 x 2 ranks + a warm spare, ZeRO-2, 150 steps
    python scripts/demo.py --no-spare           # the killed group restarts cold (torchrun)
    python scripts/demo.py --zero-stage 3 --steps 300 --kill-at 100
    python scripts/demo.py --groups 3 --no-kill

Writes event logs (JSON lines), group logs and a plot to ``--workdir``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tqdm import tqdm

from ftbridge.harness.bench.spare import capacity_back, drop_time
from ftbridge.harness.chaos.coverage import same_samples
from ftbridge.harness.chaos.verdict import grad_accum
from ftbridge.harness.local_job import LocalJob
from ftbridge.harness.report import plot_run, summarize

HEARTBEAT_TIMEOUT_S = 2.0
"""The demo lighthouse's heartbeat timeout: it drops a dead group this long after its last heartbeat."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=2, help="replica groups")
    p.add_argument("--nproc-per-node", type=int, default=2, help="ranks per replica group")
    p.add_argument("--steps", type=int, default=150,
                   help="steps to train; more if group 1 heals less than 20 steps before the end")
    p.add_argument("--zero-stage", type=int, choices=(1, 2, 3), default=2)
    p.add_argument("--kill-at", type=int, default=None, help="kill group 1 after this step (default steps/3)")
    p.add_argument("--no-kill", action="store_true", help="run without a failure")
    p.add_argument("--no-spare", action="store_true",
                   help="no warm spare group: torchrun restarts the killed group (a cold start)")
    p.add_argument("--slots", type=int, default=None,
                   help="failure-transparent training: N data-parallel slots, whatever fails (default: --groups; "
                        "0: off, a failure then shrinks the global batch)")
    p.add_argument("--workdir", default="runs/demo", help="event logs, group logs and plot")
    p.add_argument("--timeout-s", type=float, default=900)
    p.add_argument("train_args", nargs="*", help="extra arguments for scripts/train_lm.py (after --)")
    args = p.parse_args(argv)
    if args.slots is None:
        args.slots = args.groups
    if args.slots and args.slots < args.groups:
        p.error(f"--slots {args.slots}: need at least one slot per replica group ({args.groups}), or 0 for off")
    if args.kill_at is None:
        args.kill_at = max(1, args.steps // 3)
    args.spare = not args.no_spare and not args.no_kill  # a warm spare replaces the killed group
    if not args.no_kill and (args.groups < 2 or not 0 < args.kill_at < args.steps):
        p.error(f"--kill-at {args.kill_at} with --groups {args.groups}: need 2+ groups and 0 < kill-at < steps")
    return args


def _replaced(job: LocalJob, kill_time: float, spare: bool, t0: float) -> str:
    """The line that reports group 1's replacement (its heal), or "" while it has not healed."""
    mine = sorted((e for e in job.events(rank=0) if e["replica_group"] == 1), key=lambda e: e["time"])
    healed = [e for e in mine if "event" not in e and e["healed"] and e["time"] > kill_time]
    # With slots the heal's own step is discarded everywhere and tried again: report the first commit after it.
    back = [e for e in mine if "event" not in e and e["committed"] and healed and e["time"] >= healed[0]["time"]]
    if not back:
        return ""
    if not spare:
        return (f"[{back[0]['time'] - t0:6.1f}s] replica group 1 restarted, healed from a live peer and committed "
                f"step {back[0]['step']}, {back[0]['time'] - kill_time:.1f} s after the kill")
    try:
        back = capacity_back(mine, kill_time)
    except ValueError:
        return ""  # healed, not yet at full capacity
    drop = drop_time(kill_time, HEARTBEAT_TIMEOUT_S)
    return (f"[{back['time'] - t0:6.1f}s] warm spare 0 took replica group 1's place, healed from a live peer and "
            f"committed at full capacity at step {back['step']}: {back['time'] - kill_time:.1f} s after the kill, "
            f"{back['time'] - drop:.1f} s after the lighthouse dropped group 1 (at the earliest: "
            f"{HEARTBEAT_TIMEOUT_S:.0f} s heartbeat timeout)")


def watch(job: LocalJob, args: argparse.Namespace, t0: float):
    """Show progress from the event logs, kill group 1 at --kill-at, report its replacement.

    Returns:
        ``({group: exit code}, kill time or None)``; with a spare, group 1's code is the spare's.
    """
    kill_time = None
    reported = False
    spare = args.spare
    bar = tqdm(total=args.steps, unit="step", desc="job", dynamic_ncols=True)

    def running() -> bool:
        procs = [launches[-1].proc for g, launches in job.groups.items() if not (spare and g == 1)]
        return any(p.poll() is None for p in procs + ([job.spares[0].proc] if spare else []))

    while running():
        if time.time() - t0 > args.timeout_s:
            raise TimeoutError(f"demo did not finish in {args.timeout_s} s\n{job.tails()}")
        steps = [e for e in job.events(rank=0) if "event" not in e]
        done = [e for e in steps if e["committed"]]
        if done:
            last = done[-1]
            bar.update(max(0, last["step"] - bar.n))
            bar.set_postfix(loss=f"{last['loss']:.3f}", participants=last["participants"], quorum=last["quorum_id"])
        mine = [e for e in steps if e["replica_group"] == 1]
        if not args.no_kill and kill_time is None and any(e["step"] >= args.kill_at for e in mine) \
                and (not spare or job.spare_ready(0)):
            pids = job.kill_workers(1)
            kill_time = time.time()
            then = "a warm spare takes its place" if spare else "torchrun restarts group 1"
            bar.write(f"[{kill_time - t0:6.1f}s] SIGKILLed every rank of replica group 1 (pids {pids}) after "
                      f"step {args.kill_at}; the survivors go on, {then}")
        line = _replaced(job, kill_time, spare, t0) if kill_time and not reported else ""
        if line:
            reported = True
            target = max(args.steps, job.max_step() + 20)
            job.write_file("stop", str(target))
            bar.total = target
            bar.write(line)
        time.sleep(0.5)  # polling the event logs for display, not synchronisation
    bar.close()
    if not spare:
        return job.wait(30), kill_time
    codes = job.wait(30, groups=[g for g in job.groups if g != 1])
    codes[1] = job.wait_spare(0, 30)
    return codes, kill_time


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    for f in os.listdir(args.workdir):
        if f.startswith(("events_", "group_", "spare_")):
            os.remove(os.path.join(args.workdir, f))
    # The end is set through a stop file: with a kill, only once group 1 has healed, so the survivors
    # cannot finish (leaving no peer to heal from) while group 1 is still restarting.
    stop_file = os.path.join(os.path.abspath(args.workdir), "stop")
    if os.path.exists(stop_file):
        os.remove(stop_file)
    train = ["--steps", str(10**9), "--stop-file", stop_file, "--zero-stage", str(args.zero_stage),
             "--val-every", "50", *args.train_args]
    t0 = time.time()
    spare = args.spare
    # With a spare, the killed group's torchrun does not restart it: the spare replaces it (ftbridge.spare).
    with LocalJob(args.workdir, args.groups, args.nproc_per_node, train, max_restarts=0 if spare else 3,
                  heartbeat_timeout_ms=int(HEARTBEAT_TIMEOUT_S * 1000), env={"FTBRIDGE_SLOTS": str(args.slots)}) as job:
        if args.no_kill:
            job.write_file("stop", str(args.steps))
        job.start()
        if spare:
            job.start_spare(0)
        print(f"lighthouse {job.lighthouse.address}; {args.groups} replica groups x {args.nproc_per_node} ranks"
              f"{' + 1 warm spare' if spare else ''}, ZeRO-{args.zero_stage}, "
              f"{f'{args.slots} slots' if args.slots else 'slots off'}, {args.steps} steps; logs in "
              f"{args.workdir}", flush=True)
        codes, kill_time = watch(job, args, t0)
    summary = summarize(job.events(), args.groups, args.nproc_per_node)
    print(summary.table(), flush=True)
    marks = [(kill_time, "SIGKILL replica group 1")] if kill_time else []
    png = plot_run(job.events(), os.path.join(args.workdir, "run.png"), markers=marks)
    print(f"plot: {png}; wall time {time.time() - t0:.1f} s")
    samples = same_samples(job.events(), args.slots, grad_accum(args.train_args)) if args.slots else None
    if samples is not None:
        print(samples)
    ok = all(c == 0 for c in codes.values()) and summary.identical and (samples is None or samples.held)
    if not ok:
        print(f"FAILED: exit codes {codes}, identical={summary.identical}, same samples={samples}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
