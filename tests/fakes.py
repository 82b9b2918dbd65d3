"""Stand-ins for the replica manager, and the tiny engine the in-process tests build.

* :class:`FakeManager`: one replica group alone (no network, no torchft): all-reduces leave
  tensors as they are (the average over one participant), and ``should_commit`` commits unless
  the test listed the call in ``discard_calls`` or an error was reported this step. Subclass it
  to script what "the other replicas" contributed.
* :class:`FakeWorld`: several replicas in threads of this process, joined by a barrier all-reduce
  (communication hooks, the divergence guard).
* :func:`tiny_engine`: a real DeepSpeed engine (one rank) on the tiny GPT, wrapped in
  :class:`ftbridge.engine.FaultTolerantEngine` with a fake manager through its
  ``manager_factory`` seam; :func:`gpt_batch` its deterministic batches.
"""

from __future__ import annotations

import copy
import os
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch.distributed import ReduceOp

os.environ.setdefault("DS_ACCELERATOR", "cpu")


class Done:
    """A finished all-reduce work."""

    def wait(self, timeout=None):
        return True


class FakeManager:
    """Stand-in for :class:`ftbridge.manager.ReplicaManager` (same constructor and per-step calls)."""

    _torchft = None  # no torchft Manager underneath: nothing heals
    participants = 1
    replica_rank = 0
    quorum_id = 1
    healed_this_step = False
    heals = 0

    def __init__(self, cfg, *, state_dict, load_state_dict, use_cuda=False, max_heal_bytes=None):
        self.heal_state_fn, self.load_heal_state_fn = state_dict, load_state_dict
        self.restart_peer_wait_s = cfg.restart_peer_wait.total_seconds()
        self.discard_calls, self.calls, self.step, self.errors = set(), 0, 0, []
        self.ops = []  # (numel, dtype, reduce_op) per all-reduce

    current_step = property(lambda self: self.step)

    def start_quorum(self):
        pass

    def wait_quorum(self):
        pass

    pending = None
    """What :meth:`pending_heal_state` returns: a donor's ``heal_state`` the test hands over, or ``None``."""

    def pending_heal_state(self):
        return self.pending

    step_end_sent = None
    """What :meth:`publish_step_end` wrote (a donor's body), or ``None``."""
    step_end = None
    """What :meth:`fetch_step_end` returns to a rank that healed this step: a donor's body the test hands over."""

    def publish_step_end(self, body):
        self.step_end_sent = body()
        return True

    def fetch_step_end(self):
        return self.step_end if self.healed_this_step else None

    def decide(self, guard=None, empty=False, waited_s=0.0, plan=0, borrowed=False):
        """The group's decision of a one-rank group alone: commit unless an error was reported; a restarted
        group with nothing waits, then stops (ftbridge.heal.restart_without_peer, alone in its quorum)."""
        from ftbridge.heal import restart_without_peer
        from ftbridge.manager.commit import Flags, decide_group, encode_flags
        from ftbridge.manager.replica import StepVerdict

        rule = restart_without_peer(restarted_empty=empty, all_members_empty=self.participants <= 1,
                                    waited_s=waited_s, limit_s=self.restart_peer_wait_s)
        if rule == "wait":
            self.report_error(RuntimeError("restarted alone"))
        flags = Flags(step=self.step, errored=bool(self.errors), agreement=True, stop=rule == "stop")
        return StepVerdict(None, decide_group([encode_flags(flags)]))

    def state_dict(self):
        return {"step": self.step, "batches_committed": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]

    def allreduce(self, tensor, reduce_op=ReduceOp.AVG):
        self.ops.append((tensor.numel(), tensor.dtype, reduce_op))
        return Done()

    def report_error(self, e):
        self.errors.append(e)

    def errored(self):
        return self.errors[0] if self.errors else None

    def should_commit(self):
        self.calls += 1
        ok = self.calls not in self.discard_calls and not self.errors
        self.step += ok
        self.errors = []
        return ok

    def shutdown(self):
        pass


class FakeWorld:
    """Replica groups in threads of this process, joined by a barrier all-reduce.

    Args:
        n: replicas.
        healing: replicas that contribute zero (torchft zeroes a healing replica's tensor).
        step: what every replica's ``current_step`` reports.
    """

    def __init__(self, n: int, healing: Sequence[int] = (), step: int = 0) -> None:
        self.n = n
        self.healing = set(healing)
        self.step = step
        self.barrier = threading.Barrier(n)
        self.slots: List[Any] = [None] * n
        self.errors: List[Exception] = []

    def manager(self, idx: int) -> "WorldReplica":
        return WorldReplica(self, idx)

    def allreduce(self, idx: int, tensor: torch.Tensor, op: ReduceOp) -> Done:
        if idx in self.healing:
            tensor.zero_()
        self.slots[idx] = tensor
        self.barrier.wait()
        total = self.slots[0].clone()
        for t in self.slots[1:]:
            total += t
        self.barrier.wait()
        tensor.copy_(total)
        if op == ReduceOp.AVG:
            tensor /= self.n - len(self.healing)
        return Done()


class WorldReplica:
    """Replica ``idx`` of a :class:`FakeWorld`: the manager calls hooks and the guard make."""

    def __init__(self, world: FakeWorld, idx: int) -> None:
        self.world, self.idx = world, idx
        self.replica_rank = idx
        self.errors: List[Exception] = []

    def allreduce(self, tensor: torch.Tensor, reduce_op: ReduceOp = ReduceOp.AVG) -> Done:
        return self.world.allreduce(self.idx, tensor, reduce_op)

    @property
    def participants(self) -> int:
        return self.world.n - len(self.world.healing)

    @property
    def current_step(self) -> int:
        return self.world.step

    def report_error(self, e: Exception) -> None:
        self.errors.append(e)
        self.world.errors.append(e)


def run_replicas(world: FakeWorld, fn: Callable[[int], Any], timeout_s: float = 60.0) -> List[Any]:
    """``fn(i)`` for every replica ``i`` of ``world``, concurrently (each in a thread); results or exceptions.

    When a replica fails and others are still running after ``abort_after_s``, they wait on a barrier
    the failed one will never reach: the barrier is aborted then. Not at the failure itself: a replica
    may fail right after a collective that released the others, and an abort there would break them.
    """
    out: List[Any] = [None] * world.n
    failed = threading.Event()

    def one(i: int) -> None:
        try:
            out[i] = fn(i)
        except BaseException as e:  # noqa: BLE001 - returned to the caller
            out[i] = e
            failed.set()

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(world.n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    while any(t.is_alive() for t in threads):
        if failed.is_set():
            for t in threads:
                t.join(timeout=abort_after_s)
            world.barrier.abort()
        for t in threads:
            t.join(timeout=max(0.0, min(0.5, deadline - time.monotonic())))
        if time.monotonic() > deadline:
            raise TimeoutError(f"a replica of the fake world did not finish within {timeout_s} s")
    return out


abort_after_s = 2.0
"""How long :func:`run_replicas` lets the other replicas finish after one failed, seconds."""


TINY_GPT = dict(vocab_size=17, context=16, n_layer=1, d_model=32, n_head=2)
"""The tiny GPT of the in-process engine tests (5,000 parameters)."""


def _merge(base: Dict[str, Any], extra: Dict[str, Any]) -> Dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def tiny_engine(stage: int = 2, *, manager: Callable[..., Any] = None, ds: Optional[Dict[str, Any]] = None,
                ft: Optional[Dict[str, Any]] = None, model: Optional[torch.nn.Module] = None,
                optimizer: Callable[..., torch.optim.Optimizer] = None, checksum_every: int = 0,
                comm_hook: Optional[Callable[..., Any]] = None) -> Any:
    """A :class:`~ftbridge.engine.FaultTolerantEngine` on one real DeepSpeed rank (needs a 1-rank world).

    Args:
        stage: ZeRO stage.
        manager: the manager class or factory (default :class:`FakeManager`).
        ds: merged (recursively) over the default DeepSpeed config: micro batch 2, clipping 1.0,
            ``reduce_bucket_size`` 3000; an ``"ftbridge"`` section becomes ftbridge settings.
        ft: :class:`~ftbridge.config.FTBridgeConfig` fields (win over the ``"ftbridge"`` section).
        model: default the tiny GPT (seed 3), see :data:`TINY_GPT` and :func:`gpt_batch`.
        optimizer: ``optimizer(params)``; default AdamW at lr 1e-2.
    """
    import deepspeed

    from ftbridge.bootstrap import split_ds_config
    from ftbridge.config import FTBridgeConfig
    from ftbridge.engine import FaultTolerantEngine
    from ftbridge.harness.models import GPTConfig, build_model

    if model is None:
        model = build_model(GPTConfig(**TINY_GPT), seed=3)
    config = _merge({"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "steps_per_print": 10**9,
                     "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000}}, ds or {})
    config, section = split_ds_config(config)
    make_opt = optimizer or (lambda params: torch.optim.AdamW(params, lr=1e-2))
    raw, *_ = deepspeed.initialize(model=model, optimizer=make_opt(model.parameters()), config=config)
    cfg = FTBridgeConfig.resolve(environ={}, **{**section, **(ft or {})})
    return FaultTolerantEngine(raw, cfg, checksum_every=checksum_every, comm_hook=comm_hook,
                               manager_factory=manager or FakeManager)


def gpt_batch(i: int) -> tuple:
    """Batch ``i`` of the tiny GPT: ``(x, y)``, each ``(2, 16)`` int64, ``y`` the next tokens."""
    g = torch.Generator().manual_seed(i)
    x = torch.randint(0, TINY_GPT["vocab_size"], (2, 16), generator=g)
    return x, torch.roll(x, -1, 1)

