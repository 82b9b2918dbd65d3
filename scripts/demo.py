"""The main job, end to end on one machine: train, kill a replica group, heal, finish.

Starts torchft's lighthouse, launches 2 replica groups of 2 ranks (each its
own ``ftbridge-run`` / torchrun, DeepSpeed ZeRO inside the group) training a
character-level GPT on Shakespeare, SIGKILLs every rank of group 1 partway,
lets torchrun restart that group, which heals from group 0 and trains on, and
at the end prints the validation loss and every rank's parameter checksum::

    python scripts/demo.py                      # 2 x 2 ranks, ZeRO-2, 150 steps
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

from ftbridge.harness.local_job import LocalJob
from ftbridge.harness.report import plot_run, summarize


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=2, help="replica groups")
    p.add_argument("--nproc-per-node", type=int, default=2, help="ranks per replica group")
    p.add_argument("--steps", type=int, default=150,
                   help="steps to train; more if group 1 heals less than 20 steps before the end")
    p.add_argument("--zero-stage", type=int, choices=(1, 2, 3), default=2)
    p.add_argument("--kill-at", type=int, default=None, help="kill group 1 after this step (default steps/3)")
    p.add_argument("--no-kill", action="store_true", help="run without a failure")
    p.add_argument("--workdir", default="runs/demo", help="event logs, group logs and plot")
    p.add_argument("--timeout-s", type=float, default=900)
    p.add_argument("train_args", nargs="*", help="extra arguments for scripts/train_lm.py (after --)")
    args = p.parse_args(argv)
    if args.kill_at is None:
        args.kill_at = max(1, args.steps // 3)
    if not args.no_kill and (args.groups < 2 or not 0 < args.kill_at < args.steps):
        p.error(f"--kill-at {args.kill_at} with --groups {args.groups}: need 2+ groups and 0 < kill-at < steps")
    return args


def watch(job: LocalJob, args: argparse.Namespace, t0: float):
    """Show progress from the event logs, kill group 1 at --kill-at, report its heal.

    Returns:
        ``({group: exit code}, kill time or None)``.
    """
    kill_time = None
    heal_reported = False
    bar = tqdm(total=args.steps, unit="step", desc="job", dynamic_ncols=True)
    while any(launches[-1].proc.poll() is None for launches in job.groups.values()):
        if time.time() - t0 > args.timeout_s:
            raise TimeoutError(f"demo did not finish in {args.timeout_s} s\n{job.tails()}")
        steps = [e for e in job.events(rank=0) if "event" not in e]
        done = [e for e in steps if e["committed"]]
        if done:
            last = done[-1]
            bar.update(max(0, last["step"] - bar.n))
            bar.set_postfix(loss=f"{last['loss']:.3f}", participants=last["participants"], quorum=last["quorum_id"])
        mine = [e for e in steps if e["replica_group"] == 1]
        if not args.no_kill and kill_time is None and any(e["step"] >= args.kill_at for e in mine):
            pids = job.kill_workers(1)
            kill_time = time.time()
            bar.write(f"[{kill_time - t0:6.1f}s] SIGKILLed every rank of replica group 1 (pids {pids}) after "
                      f"step {args.kill_at}; the survivors go on, torchrun restarts group 1")
        healed = [e for e in mine if kill_time and e["healed"] and e["time"] > kill_time]
        if healed and not heal_reported:
            heal_reported = True
            target = max(args.steps, job.max_step() + 20)
            job.write_file("stop", str(target))
            bar.total = target
            bar.write(f"[{healed[0]['time'] - t0:6.1f}s] replica group 1 restarted and healed from a live peer "
                      f"at step {healed[0]['step']}, {healed[0]['time'] - kill_time:.1f} s after the kill")
        time.sleep(0.5)  # polling the event logs for display, not synchronisation
    bar.close()
    return job.wait(30), kill_time


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    for f in os.listdir(args.workdir):
        if f.startswith(("events_", "group_")):
            os.remove(os.path.join(args.workdir, f))
    # The end is set through a stop file: with a kill, only once group 1 has healed, so the survivors
    # cannot finish (leaving no peer to heal from) while group 1 is still restarting.
    stop_file = os.path.join(os.path.abspath(args.workdir), "stop")
    if os.path.exists(stop_file):
        os.remove(stop_file)
    train = ["--steps", str(10**9), "--stop-file", stop_file, "--zero-stage", str(args.zero_stage),
             "--val-every", "50", *args.train_args]
    t0 = time.time()
    with LocalJob(args.workdir, args.groups, args.nproc_per_node, train) as job:
        if args.no_kill:
            job.write_file("stop", str(args.steps))
        job.start()
        print(f"lighthouse {job.lighthouse.address}; {args.groups} replica groups x {args.nproc_per_node} ranks, "
              f"ZeRO-{args.zero_stage}, {args.steps} steps; logs in {args.workdir}", flush=True)
        codes, kill_time = watch(job, args, t0)
    summary = summarize(job.events(), args.groups, args.nproc_per_node)
    print(summary.table(), flush=True)
    marks = [(kill_time, "SIGKILL replica group 1")] if kill_time else []
    png = plot_run(job.events(), os.path.join(args.workdir, "run.png"), markers=marks)
    print(f"plot: {png}; wall time {time.time() - t0:.1f} s")
    ok = all(c == 0 for c in codes.values()) and summary.identical
    if not ok:
        print(f"FAILED: exit codes {codes}, identical={summary.identical}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
