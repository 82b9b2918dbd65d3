"""Benchmark replica-group checkpoints against plain DeepSpeed, on the main job's model.

Two measurements, each with the same model (char-level GPT, 827,648
parameters, ZeRO-2, ``train_lm.py`` defaults) and the same torchrun
invocation of this script's workers (2 ranks = one replica group of 2)::

1. Training stall per checkpoint: time on the training thread of DeepSpeed's
   plain ``save_checkpoint``, of ftbridge's sync save (same DeepSpeed files,
   plus fsync, manifest and atomic publish) and of ftbridge's async save
   (CPU snapshot; the write runs in the background during the next steps);
   plus the time of the step right after each save (the background write
   competes for the CPU).
2. Resume at a different number of ranks: a 4-rank job (plain DeepSpeed
   data parallel over 4 ranks, or ftbridge with 2 groups x 2) resumes on 2
   ranks. Plain DeepSpeed must convert (``ds_to_universal
   --inject_missing_state``) and load the universal checkpoint; ftbridge's
   group checkpoint loads directly (after verifying its manifest).

Run::

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_checkpoint.py [--saves 8] [--out runs/bench_checkpoint]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


# -- workers (run under torchrun) ------------------------------------------------------------------
def _engine(extra_config=None):
    import deepspeed
    import torch
    import torch.distributed as dist

    from ftbridge import lm_job

    torch.set_num_threads(1)
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    args = lm_job.build_parser().parse_args([])
    data, model = lm_job.build_data_and_model(args)
    cfg = lm_job.ds_config(args)
    cfg.update(extra_config or {})
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    topo = lm_job.Topology(dist.get_rank(), dist.get_world_size(), 0, dist.get_rank())
    return engine, data, topo, args


def _step(engine, data, topo, args):
    from ftbridge import lm_job

    t = time.perf_counter()
    lm_job.train_step(engine, data, topo, args.grad_accum)
    return time.perf_counter() - t


def _ft_save(engine, store, writer=None):
    import torch.distributed as dist

    from ftbridge.checkpoint.group_io import save_group_checkpoint

    step = int(engine.global_steps)
    meta = {"format": "ftbridge-checkpoint/1", "step": step, "group_size": dist.get_world_size(), "zero_stage": 2,
            "quorum": {"quorum_id": 0, "participants": 1, "replica_rank": 0, "replica_group_id": 0},
            "manager": {"step": step, "batches_committed": step}}
    return save_group_checkpoint(engine, store, step, quorum_id=0, metadata=meta,
                                 rank_state={"micro_steps": int(engine.micro_steps), "extra": {}}, keep=2,
                                 writer=writer).stall_s


def worker_stall(out, saves):
    import torch.distributed as dist

    from ftbridge.checkpoint.async_save import BackgroundWriter
    from ftbridge.checkpoint.store import CheckpointStore

    engine, data, topo, args = _engine()
    for _ in range(5):
        _step(engine, data, topo, args)
    base = [_step(engine, data, topo, args) for _ in range(10)]
    results = {"step_s": statistics.median(base)}
    writer = BackgroundWriter()
    modes = {
        "deepspeed": lambda: _timed(lambda: engine.save_checkpoint(os.path.join(out, "ds_plain"))),
        "ftbridge_sync": lambda: _ft_save(engine, CheckpointStore(os.path.join(out, "ft_sync"))),
        "ftbridge_async": lambda: _ft_save(engine, CheckpointStore(os.path.join(out, "ft_async")), writer),
    }
    for name, save in modes.items():
        stalls, next_steps = [], []
        for _ in range(saves):
            _step(engine, data, topo, args)
            dist.barrier()
            stalls.append(save())
            next_steps.append(_step(engine, data, topo, args))
        writer.wait()
        results[name] = {"stall_s": statistics.median(stalls), "next_step_s": statistics.median(next_steps)}
    # Keep a checkpoint of this group for the resume measurement.
    _ft_save(engine, CheckpointStore(os.path.join(out, "ft_resume")))
    if dist.get_rank() == 0:
        with open(os.path.join(out, "stall.json"), "w") as f:
            json.dump(results, f)


def _timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def worker_plain_save(out):
    engine, data, topo, args = _engine()
    for _ in range(3):
        _step(engine, data, topo, args)
    engine.save_checkpoint(os.path.join(out, "ds_resume"))


def worker_load(out, kind):
    import torch.distributed as dist

    if kind == "universal":
        engine, *_ = _engine({"checkpoint": {"load_universal": True}})
        dist.barrier()
        t = time.perf_counter()
        root = os.path.join(out, "ds_resume")
        with open(os.path.join(root, "latest_universal"), encoding="utf-8") as f:
            tag = f.read().strip()
        path, _ = engine.load_checkpoint(root, tag=tag)
    else:
        from ftbridge.checkpoint.group_io import load_group_checkpoint
        from ftbridge.checkpoint.store import CheckpointStore, check_compatible

        engine, *_ = _engine()
        dist.barrier()
        t = time.perf_counter()
        ckpt = CheckpointStore(os.path.join(out, "ft_resume")).find_valid()
        check_compatible(ckpt.metadata(), ckpt.path, group_size=dist.get_world_size(), zero_stage=2)
        load_group_checkpoint(engine, ckpt)
        path = ckpt.path
    dist.barrier()
    elapsed = time.perf_counter() - t
    assert path is not None and int(engine.global_steps) > 0, (path, engine.global_steps)
    if dist.get_rank() == 0:
        with open(os.path.join(out, f"load_{kind}.json"), "w") as f:
            json.dump({"load_s": elapsed, "global_steps": int(engine.global_steps)}, f)


# -- driver -----------------------------------------------------------------------------------------
def torchrun(nproc, argv, timeout_s=600):
    from ftbridge.launcher import find_free_port

    port = find_free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"bench{port}", os.path.abspath(__file__), *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return time.perf_counter() - t


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(REPO, "runs", "bench_checkpoint"))
    p.add_argument("--saves", type=int, default=8, help="checkpoints per mode for the stall medians")
    p.add_argument("--repeats", type=int, default=2, help="load processes per kind (best is reported)")
    p.add_argument("--worker", choices=("stall", "plain_save", "load_universal", "load_ftbridge"), default=None)
    args = p.parse_args()
    out = os.path.abspath(args.out)
    if args.worker == "stall":
        return worker_stall(out, args.saves) or 0
    if args.worker == "plain_save":
        return worker_plain_save(out) or 0
    if args.worker:
        return worker_load(out, args.worker.split("_", 1)[1]) or 0

    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    print(f"1/5 stall per checkpoint, 2 ranks, {args.saves} saves per mode ...", flush=True)
    torchrun(2, ["--worker", "stall", "--out", out, "--saves", str(args.saves)])
    print("2/5 plain DeepSpeed: save on 4 ranks ...", flush=True)
    torchrun(4, ["--worker", "plain_save", "--out", out])
    print("3/5 ds_to_universal --inject_missing_state ...", flush=True)
    with open(os.path.join(out, "ds_resume", "latest"), encoding="utf-8") as f:
        tag = f.read().strip()
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                    os.path.join(out, "ds_resume", tag), "--output_folder",
                    os.path.join(out, "ds_resume", f"{tag}_universal"), "--inject_missing_state"],
                   check=True, capture_output=True, timeout=600)
    convert_s = time.perf_counter() - t
    print(f"4/5 and 5/5: load on 2 ranks, plain DeepSpeed universal and ftbridge, alternating, best of "
          f"{args.repeats} ...", flush=True)
    runs = {"universal": [], "ftbridge": []}
    for _ in range(args.repeats):  # alternate, so load from other users of the machine hits both alike
        for kind in runs:
            wall = torchrun(2, ["--worker", f"load_{kind}", "--out", out])
            runs[kind].append((wall, json.load(open(os.path.join(out, f"load_{kind}.json")))["load_s"]))
    universal_proc_s, ft_proc_s = (min(w for w, _ in runs[k]) for k in ("universal", "ftbridge"))
    uni = {"load_s": min(t for _, t in runs["universal"])}
    ft = {"load_s": min(t for _, t in runs["ftbridge"])}
    stall = json.load(open(os.path.join(out, "stall.json")))
    ds = stall["deepspeed"]
    print(f"\nmedian training step {stall['step_s'] * 1e3:.1f} ms (2 ranks, ZeRO-2, 827,648 parameters)")
    print(f"{'save':<16}{'stall ms':>10}{'vs DeepSpeed':>14}{'next step ms':>14}")
    for name in ("deepspeed", "ftbridge_sync", "ftbridge_async"):
        r = stall[name]
        print(f"{name:<16}{r['stall_s'] * 1e3:>10.1f}{r['stall_s'] / ds['stall_s']:>13.2f}x"
              f"{r['next_step_s'] * 1e3:>14.1f}")
    plain_total = convert_s + uni["load_s"]
    print("\nresume a 4-rank job on 2 ranks")
    print(f"  plain DeepSpeed: ds_to_universal {convert_s:.2f} s + load_universal {uni['load_s']:.3f} s "
          f"= {plain_total:.2f} s (load process {universal_proc_s:.1f} s wall)")
    print(f"  ftbridge:        verify + load {ft['load_s']:.3f} s, no conversion (load process {ft_proc_s:.1f} s wall)")
    print(f"  ratio plain/ftbridge: {plain_total / ft['load_s']:.1f}x (checkpoint to loaded state); end to end "
          f"incl. process start: {(convert_s + universal_proc_s) / ft_proc_s:.2f}x")
    summary = {"stall": stall, "convert_s": convert_s, "load_universal_s": uni["load_s"],
               "load_ftbridge_s": ft["load_s"],
               "universal_proc_s": universal_proc_s, "ftbridge_proc_s": ft_proc_s}
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
