"""torchrun workers of the rescale benchmark and of ``scripts/bench_checkpoint.py``.

Run as a script under torchrun (one plain DeepSpeed world, main job's model
or the flags after ``--``)::

    torchrun --nproc-per-node 2 ftbridge/harness/bench/rescale_worker.py --worker plain_save --out DIR [-- MODEL FLAGS]

Workers: ``plain_save`` (DeepSpeed ``save_checkpoint`` to ``DIR/ds_resume``),
``ft_save`` (an ftbridge replica-group checkpoint of this world to
``DIR/ft_resume``), ``load_universal`` / ``load_ftbridge`` (time the load
only, written to ``DIR/load_<kind>.json``), and ``stall`` (training stall per
checkpoint save, written to ``DIR/stall.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from ftbridge.launch.build_lock import prepare_jit_build

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))


def _engine(model_flags: List[str], extra_config: Optional[Dict[str, Any]] = None) -> Tuple[Any, Any, Any, Any]:
    import deepspeed
    import torch
    import torch.distributed as dist

    from ftbridge.harness import lm_job

    torch.set_num_threads(1)
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    args = lm_job.build_parser().parse_args(model_flags)
    data, model = lm_job.build_data_and_model(args)
    cfg = lm_job.ds_config(args)
    cfg.update(extra_config or {})
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    topo = lm_job.Topology(dist.get_rank(), dist.get_world_size(), 0, dist.get_rank())
    return engine, data, topo, args


def _step(engine: Any, data: Any, topo: Any, args: Any) -> float:
    from ftbridge.harness import lm_job

    t = time.perf_counter()
    lm_job.train_step(engine, data, topo, args.grad_accum)
    return time.perf_counter() - t


def _timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _ft_save(engine: Any, store: Any, zero_stage: int, writer: Any = None) -> float:
    """Save this world as one replica group's checkpoint; returns the training stall (s)."""
    import torch.distributed as dist

    from ftbridge.checkpoint.group_io import save_group_checkpoint

    step = int(engine.global_steps)
    meta = {"format": "ftbridge-checkpoint/1", "step": step, "group_size": dist.get_world_size(),
            "zero_stage": zero_stage,
            "quorum": {"quorum_id": 0, "participants": 1, "replica_rank": 0, "replica_group_id": 0},
            "manager": {"step": step, "batches_committed": step}}
    return save_group_checkpoint(engine, store, step, quorum_id=0, metadata=meta,
                                 rank_state={"micro_steps": int(engine.micro_steps), "extra": {}}, keep=2,
                                 writer=writer).stall_s


def worker_save(out: str, kind: str, model_flags: List[str]) -> None:
    """Train 3 steps, then save a plain DeepSpeed (``plain``) or ftbridge group (``ft``) checkpoint."""
    from ftbridge.checkpoint.store import CheckpointStore

    engine, data, topo, args = _engine(model_flags)
    for _ in range(3):
        _step(engine, data, topo, args)
    if kind == "plain":
        engine.save_checkpoint(os.path.join(out, "ds_resume"))
    else:
        _ft_save(engine, CheckpointStore(os.path.join(out, "ft_resume")), args.zero_stage)


def worker_load(out: str, kind: str, model_flags: List[str]) -> None:
    """Time the load of the saved checkpoint into this world (``universal`` or ``ftbridge``) and record it."""
    import torch.distributed as dist

    if kind == "universal":
        engine, *_ = _engine(model_flags, {"checkpoint": {"load_universal": True}})
        dist.barrier()
        t = time.perf_counter()
        root = os.path.join(out, "ds_resume")
        with open(os.path.join(root, "latest_universal"), encoding="utf-8") as f:
            tag = f.read().strip()
        path, _ = engine.load_checkpoint(root, tag=tag)
    else:
        from ftbridge.checkpoint.group_io import load_group_checkpoint
        from ftbridge.checkpoint.store import CheckpointStore, check_compatible

        engine, _, _, args = _engine(model_flags)
        dist.barrier()
        t = time.perf_counter()
        ckpt = CheckpointStore(os.path.join(out, "ft_resume")).find_valid(hash_torch_files=False)
        if ckpt is None:
            raise RuntimeError(f"no valid ftbridge checkpoint in {os.path.join(out, 'ft_resume')}")
        check_compatible(ckpt.metadata(), ckpt.path, group_size=dist.get_world_size(), zero_stage=args.zero_stage)
        load_group_checkpoint(engine, ckpt)
        path = ckpt.path
    dist.barrier()
    elapsed = time.perf_counter() - t
    if path is None or int(engine.global_steps) <= 0:
        raise RuntimeError(f"load_{kind}: nothing loaded (path={path}, global_steps={engine.global_steps})")
    if dist.get_rank() == 0:
        with open(os.path.join(out, f"load_{kind}.json"), "w", encoding="utf-8") as f:
            json.dump({"load_s": elapsed, "global_steps": int(engine.global_steps)}, f)


def worker_stall(out: str, saves: int, model_flags: List[str]) -> None:
    """Training stall of DeepSpeed ``save_checkpoint`` and ftbridge sync/async saves (medians of ``saves``)."""
    import torch.distributed as dist

    from ftbridge.checkpoint.async_save import BackgroundWriter
    from ftbridge.checkpoint.store import CheckpointStore

    engine, data, topo, args = _engine(model_flags)
    for _ in range(5):
        _step(engine, data, topo, args)
    results: Dict[str, Any] = {"step_s": statistics.median(_step(engine, data, topo, args) for _ in range(10))}
    writer = BackgroundWriter()
    modes = {
        "deepspeed": lambda: _timed(lambda: engine.save_checkpoint(os.path.join(out, "ds_plain"))),
        "ftbridge_sync": lambda: _ft_save(engine, CheckpointStore(os.path.join(out, "ft_sync")), args.zero_stage),
        "ftbridge_async": lambda: _ft_save(engine, CheckpointStore(os.path.join(out, "ft_async")), args.zero_stage,
                                           writer),
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
    if dist.get_rank() == 0:
        with open(os.path.join(out, "stall.json"), "w", encoding="utf-8") as f:
            json.dump(results, f)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", required=True, choices=("plain_save", "ft_save", "load_universal", "load_ftbridge",
                                                        "stall"))
    p.add_argument("--out", required=True)
    p.add_argument("--saves", type=int, default=8)
    p.add_argument("model_flags", nargs="*", help="training-job flags after --")
    args = p.parse_args(argv)
    prepare_jit_build()
    out = os.path.abspath(args.out)
    if args.worker == "stall":
        worker_stall(out, args.saves, args.model_flags)
    elif args.worker.endswith("_save"):
        worker_save(out, args.worker.split("_")[0], args.model_flags)
    else:
        worker_load(out, args.worker.split("_", 1)[1], args.model_flags)
    return 0


if __name__ == "__main__":
    sys.exit(main())
