"""The DeepSpeed engine wrapper: quorum, gradient sync, commit or discard.

:func:`ftbridge.initialize` mirrors ``deepspeed.initialize`` and returns a :class:`FaultTolerantEngine`,
which wraps the DeepSpeed engine::

    engine, optimizer, _, scheduler = ftbridge.initialize(model=model, optimizer=opt, config=ds_config)
    for batch in data:
        loss = engine(batch)          # 1st micro-step: starts the quorum (async)
        engine.backward(loss)         # boundary: cross-replica all-reduce of the partition
        engine.step()                 # boundary: should_commit -> DeepSpeed step, or discard

A discarded step leaves optimizer, scheduler, loss scaler and DeepSpeed's step counters untouched.
Why: docs/concepts.md, "Where the sync sits in a ZeRO step" and "Commit or discard".
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from ftbridge import comm_hooks, faults, metrics
from ftbridge.config import FTBridgeConfig
from ftbridge.events import EventLog, tensor_checksum
from ftbridge.guard import DivergenceGuard
from ftbridge.heal import NoPeerToHealFrom, joined_empty, lazy_state_bytes
from ftbridge.heal.extra import ExtraState
from ftbridge.heal.wire import size_bound
from ftbridge.log import get_logger
from ftbridge.manager import ReplicaManager
from ftbridge.slots import Unit
from ftbridge.slots import steps as slot_steps
from ftbridge.zero.adapter import ZeroAdapter
from ftbridge.zero.engine_points import align_to_window, gradient_reduction, wrap_model_step
from ftbridge.zero.grad_sync import build_sync, checked_adapter
from ftbridge.zero.state import from_wire, to_wire

_COUNTERS = ("global_steps", "global_samples", "skipped_steps")


class FaultTolerantEngine:
    """A DeepSpeed engine whose optimizer steps follow torchft's commit protocol.

    Other attributes fall through to the wrapped ``deepspeed.DeepSpeedEngine``.

    Args:
        engine: an initialised DeepSpeed engine whose world is one replica group.
        cfg: resolved ftbridge configuration.
        checksum_every, comm_hook: override ``cfg``'s (a hook is ``hook(state, flat) -> work``).
        manager_factory: builds the manager (test seam); default :class:`ftbridge.manager.ReplicaManager`.
        in_place: :func:`ftbridge.attach` installs this object's ``forward``, ``backward`` and ``step`` on
            ``engine``; DeepSpeed's own are bound before that.

    Raises:
        ValueError: ``checksum_every < 0``, or a ``slots`` setting this engine cannot run.
    """

    def __init__(self, engine: Any, cfg: FTBridgeConfig, *, checksum_every: Optional[int] = None,
                 comm_hook: Optional[Callable[..., Any]] = None,
                 manager_factory: Optional[Callable[..., ReplicaManager]] = None, in_place: bool = False) -> None:
        self.engine = engine
        # Bound now: in place, the engine's attributes become this object's methods (no recursion), and
        # engine(...) has run torch's module hooks around the installed forward already.
        self._ds_forward: Callable[..., Any] = engine.forward if in_place else engine
        self._ds_backward: Callable[..., Any] = engine.backward
        self._ds_step: Callable[..., Any] = engine.step
        self.cfg = cfg
        self.adapter: ZeroAdapter = checked_adapter(engine)
        self.checksum_every = cfg.checksum_every if checksum_every is None else checksum_every
        if self.checksum_every < 0:
            raise ValueError(f"checksum_every={self.checksum_every} must be >= 0 (0: never write a parameter checksum)")
        self.extra = ExtraState()
        self._step_hooks: list = []
        self.log = get_logger("ftbridge.engine", cfg, step_fn=lambda: self.manager.current_step)
        self.manager = (manager_factory or ReplicaManager)(cfg, state_dict=self.heal_state,
                                                           load_state_dict=self.load_heal_state,
                                                           use_cuda=next(engine.module.parameters()).is_cuda,
                                                           max_heal_bytes=self.heal_size_bound)
        hook, hook_state = comm_hooks.build(comm_hook or cfg.comm_hook, cfg.comm_wrapper, cfg.comm_state_option,
                                            self.manager, reduction=gradient_reduction(engine))
        hook_state.slots = cfg.slots
        refused = slot_steps.refusal(cfg, engine, self.adapter, hook_state)
        if refused:
            raise ValueError(refused)
        self.slot_plan: List[Tuple[int, int]] = []
        """``(slot, micro)`` of every unit this group computes in the current attempt (:meth:`units`)."""
        self._plan = slot_steps.plan_digest(cfg, engine)
        if cfg.slots:
            self.log.info("slots on: %d slots of %d micro-batch(es) each per optimizer step, computed by whichever "
                          "replica groups take part (FTBRIDGE_SLOTS=0 turns them off)", cfg.slots,
                          engine.gradient_accumulation_steps())
        self.sync = build_sync(self.adapter, self.manager, cfg.sync_mode, cfg.cross_replica_bucket_bytes,
                               hook=hook, hook_state=hook_state)
        wrap_model_step(engine, self._model_step)
        if hook_state.state_dict() is not None:  # shared hook state (PowerSGD's Q, iteration) travels in a heal
            self.register_state("comm_hook", hook_state.state_dict, hook_state.load_state_dict)
        # pid: a group's log may hold records of two processes at once (a paused group that resumes after a
        # warm spare took its id writes its late records there until it leaves); readers tell them apart by it.
        self.events = EventLog(cfg.event_log_path(),
                               {"replica_group": cfg.replica_group_id, "group_rank": cfg.group_rank,
                                "pid": os.getpid()})

        self.metrics = metrics.attach(self)  # Prometheus /metrics on group rank 0 when FTBRIDGE_METRICS_PORT is set
        self.guard = DivergenceGuard(self.adapter, replica_group_id=cfg.replica_group_id, every=cfg.guard_every,
                                     action=cfg.guard_action, on_tie=cfg.guard_on_tie, events=self.events)

        self._in_step = False
        self.cross_replica_wait_s = 0.0
        """Seconds ``step()`` blocked on cross-replica all-reduces unfinished at the end of backward, summed."""
        self._window_start = 0
        self._backwards = 0          # backward calls in this optimizer step's window
        self._boundary_backward = False  # the window's boundary backward has run
        self._deferred_backward = False  # a backward ran under no_sync / coalesce_grad_reduction
        self._decision: Optional[bool] = None
        self._losses: list = []
        self._t0 = 0.0
        self.last_committed: Optional[bool] = None
        self._first_step_checked = False
        self._heal_first = False  # a restarted group before its first commit (_prepare_heal_receive)
        self._launched = time.time()
        self._joined_empty = joined_empty(restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                                          spare_index=cfg.spare_index, num_replica_groups=cfg.num_replica_groups)
        self._committed_since_launch = False  # a joiner that committed holds its group's history (View.borrowed)
        self._prepare_heal_receive()
        self.events.write(event="start", time=time.time(), step=0, pid=os.getpid(), zero_stage=self.adapter.stage,
                          group_size=cfg.group_size, sync_mode=cfg.sync_mode, offload=self.adapter.offload,
                          sync_fallback=getattr(self.sync, "fallback_reason", "") or None,
                          device=str(getattr(engine, "device", "cpu")),
                          cross_replica_backend=getattr(self.manager, "backend", None))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["engine"], name)

    # -- user-registered state (e.g. the data position) ---------------------
    def register_state(self, key: str, state_dict: Callable[[], Dict[str, Any]],
                       load_state_dict: Callable[[Dict[str, Any]], None], *, at_step_start: bool = False) -> None:
        """Add state that a heal must carry, e.g. the data loader position.

        Args:
            key: unique name.
            state_dict: returns a nested dict of tensors and JSON scalars; clone any tensor that forward or
                backward changes (a heal reads tensors in place until the optimizer step).
            load_state_dict: applies a peer's value.
            at_step_start: read ``state_dict`` at the start of every step, before the forward, and carry that
                value; a group healing before its first forward applies it then (the random generators:
                :mod:`ftbridge.heal.rng`).

        Raises:
            ValueError: ``key`` is already registered.
        """
        self.extra.register(key, state_dict, load_state_dict, at_step_start=at_step_start)

    def add_step_hook(self, hook: Callable[[bool], None]) -> None:
        """Call ``hook(committed)`` after every boundary step, on every rank (e.g. checkpoints)."""
        self._step_hooks.append(hook)

    # -- training loop ----------------------------------------------------
    def units(self) -> Iterator[Unit]:
        """The units (:class:`ftbridge.slots.Unit`) of the current step; run forward and backward on each one's rows.

        The boundary is set on the last unit. With ``slots``: this group's share of every slot; else its own
        micro-batches. Raises ``RuntimeError`` inside a step.
        """
        return slot_steps.units(self)

    def set_step_weight(self, weight: float) -> None:
        """Weight this group's gradient by ``weight`` in the current optimizer step's cross-replica average.

        For a loss normalised per group by a count that differs between groups (the label tokens of padded
        rows, as the Trainer's ``average_tokens_across_devices`` counts them within a group): pass that count,
        the same on every rank of the group, before the step's last backward; the step then averages
        ``sum_g count_g * grad_g / sum_g count_g`` over the participants, which is plain data parallelism's
        result with the count summed over the whole job. Applies to one step; unset, groups count alike.

        Raises:
            ValueError: ``weight`` negative or not finite, ``gradient_allreduce_op`` ``"sum"``, or a PowerSGD hook.
        """
        device = next(self.engine.module.parameters()).device
        self.sync.hook_state.set_weight(weight, device=device if device.type == "cuda" else "cpu")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """DeepSpeed forward; the first micro-step of a window starts the quorum.

        Raises:
            RuntimeError: with ``slots``, a training forward outside :meth:`units`.
        """
        if self.engine.module.training and not self._in_step:
            if self.cfg.slots:
                raise RuntimeError(
                    f"slots={self.cfg.slots} (FTBRIDGE_SLOTS): run every training forward inside "
                    "'for unit in engine.units():', reading the rows the unit names; a step begun outside it "
                    "would leave the units of absent replica groups untrained")
            self._begin_step()
        return self._ds_forward(*args, **kwargs)

    def _begin_step(self) -> None:
        self._in_step = True
        self._t0 = time.time()
        self._losses = []
        self._window_start = int(self.engine.micro_steps)
        self._backwards = 0
        self._boundary_backward = self._deferred_backward = False
        self.adapter.begin_window()
        self.extra.begin_step()  # before the quorum thread may read it for a joiner
        self.manager.start_quorum()
        if self._heal_first:
            self.manager.wait_quorum()  # the heal fetch runs alone (_prepare_heal_receive)
            received = self.manager.pending_heal_state()
            if received is not None:
                self.extra.load(received["replica"].get("extra", {}), before_forward=True)
        if not self._first_step_checked and faults.armed("first_quorum"):
            self.manager.wait_quorum()  # in the quorum, before training a single step
            faults.point("first_quorum")

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> Any:
        """DeepSpeed backward; at the boundary, the cross-replica all-reduce starts.

        Raises:
            RuntimeError: no training forward first, or a second boundary backward without ``step()``.
            ValueError: a second backward where DeepSpeed cannot accumulate exactly (ZeRO-1, ``overlap_comm``).
        """
        if not self._in_step:
            raise RuntimeError("backward() without a training forward(): call engine(batch) in train() mode first")
        if self._boundary_backward:
            raise RuntimeError(
                f"backward() called again after the backward of the gradient accumulation boundary, without "
                f"step() in between (gradient_accumulation_steps={self.engine.gradient_accumulation_steps()}, "
                f"{self._backwards} backward calls in this step): that gradient was already final. To accumulate "
                "N micro-batches per optimizer step, either set gradient_accumulation_steps=N and call step() "
                "after every backward, or call engine.set_gradient_accumulation_boundary(False) before each "
                "backward but the last and (True) before the last, then step() once")
        if self._backwards == 1 and self.adapter.accumulation_refused():
            raise ValueError(self.adapter.accumulation_refused())
        e = self.engine
        boundary = bool(e.is_gradient_accumulation_boundary())
        no_sync = bool(getattr(e, "inside_no_sync_ctxt", False))
        self.sync.begin_backward(boundary=boundary, first=self._backwards == 0, no_sync=no_sync)
        self._backwards += 1
        self._losses.append(float(loss.detach().float()))
        if boundary and not no_sync and faults.armed("in_allreduce"):
            self.manager.wait_quorum()  # now every peer's all-reduce of this step counts on this rank
            faults.point("in_allreduce", f"after joining the quorum of step {int(e.global_steps)}, "
                                         "before its all-reduce")
        out = self._ds_backward(loss, **kwargs)
        self.sync.end_backward(boundary=boundary, no_sync=no_sync)
        self._boundary_backward = boundary and not no_sync
        self._deferred_backward |= no_sync
        if self._backwards % (1000 * e.gradient_accumulation_steps()) == 0:
            self.log.warning("%d backward calls without an optimizer step: DeepSpeed steps only when a backward "
                             "runs at the gradient accumulation boundary; call "
                             "engine.set_gradient_accumulation_boundary(True) before the last backward of a step",
                             self._backwards)
        return out

    def step(self, **kwargs: Any) -> None:
        """DeepSpeed step; where DeepSpeed steps the optimizer, average, vote, then commit or discard.

        Raises:
            RuntimeError: the boundary backward ran but DeepSpeed did not step (boundary unset before ``step()``).
        """
        self._decision = None
        self._ds_step(**kwargs)
        committed, self._decision = self._decision, None
        if committed is None:
            if self._boundary_backward:
                raise RuntimeError(
                    "the last backward ran at the gradient accumulation boundary, but step() did not step the "
                    "optimizer (set_gradient_accumulation_boundary(False) after that backward?): keep the "
                    "boundary set from the last backward of an optimizer step until step() returns")
            return
        self._in_step = False
        self.extra.end_step()
        self._boundary_backward = False
        self.last_committed = committed
        self._record(committed)
        for hook in self._step_hooks:
            hook(committed)

    def _model_step(self, take_model_step: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Runs in place of DeepSpeed's optimizer step, on the assembled partition: average, vote, step or discard."""
        e = self.engine
        if (e.managed_gradient_accumulation() and self._backwards and not self._boundary_backward
                and not self._deferred_backward):
            raise RuntimeError(
                "DeepSpeed is stepping the optimizer, but no backward of this step ran at the gradient "
                "accumulation boundary, so DeepSpeed never assembled the gradient partition: call "
                "engine.set_gradient_accumulation_boundary(True) before the last backward of the step")
        t_wait = time.perf_counter()
        self.sync.wait()
        self.cross_replica_wait_s += time.perf_counter() - t_wait
        step = self.manager.current_step
        empty = self._joined_empty and step == 0 and self.manager.heals == 0
        borrowed = self._joined_empty and not self._committed_since_launch  # healed from a peer, not committed since
        if self.extra.forward_consumed:  # a donor's generators as its forward left them, for a mid-step joiner
            self.manager.publish_step_end(self.extra.step_end_body)
        verdict = self.manager.decide(guard=self.guard.digest(step), empty=empty,  # the group's one decision
                                      waited_s=time.time() - self._launched, plan=self._plan, borrowed=borrowed)
        if verdict.decision.stop:
            self.events.write(event="restart_without_peer", time=time.time(), step=step, stopped=True,
                              attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
            raise NoPeerToHealFrom(
                f"replica group {self.cfg.replica_group_id} was restarted with nothing to start from (or is a warm "
                f"spare that took its id) and found no "
                f"replica group holding the job's state to heal from within restart_peer_wait "
                f"({self.cfg.restart_peer_wait.total_seconds():g} s, FTBRIDGE_RESTART_PEER_WAIT_S): the other "
                "groups have finished or died. It does not train alone from step 0, which would make a second, "
                "different model; resume the job from a checkpoint (--resume) instead")
        self.guard.act(step, verdict.agreement.guard if verdict.agreement else None, verdict.decision)
        committed = self.manager.should_commit()
        if committed and self.manager.healed_this_step and self.extra.forward_consumed:
            self._take_step_end()
        if committed:
            self.sync.commit()
            self.adapter.prepare_step()  # after a heal in should_commit too: from the averaged partition
            take_model_step(*args, **kwargs)
        else:
            self.sync.reset()
            self.adapter.discard_window()
        self._decision = committed
        self._committed_since_launch |= committed

    def _take_step_end(self) -> None:
        """A joiner whose heal step committed: the donor's forward-consumed entries as they stood at its vote
        (:mod:`ftbridge.manager.step_end`); without them it keeps those the heal carried (one step behind)."""
        body = self.manager.fetch_step_end()
        if body is None:
            return
        try:
            self.extra.load_step_end(body)
            self.log.info("took the donor's at_step_start state (random generators) as it stood at the heal step's "
                          "vote (%d bytes)", len(body))
        except Exception as exc:  # noqa: BLE001 - a peer's body (hostile input) must not stop this rank
            self.log.warning("the donor's state at the heal step's end was not applied (%s: %s): this rank "
                             "continues from the state read at the step's start", type(exc).__name__, exc)

    def _record(self, committed: bool) -> None:
        m = self.manager
        step = m.current_step
        if committed and not self._first_step_checked:  # a discarded step (a heal that failed) proves nothing
            self._first_step_checked = True
            self._check_restart_had_peer(step)
        checksum = None
        if self.checksum_every and step % self.checksum_every == 0:
            checksum = tensor_checksum(self.adapter.full_parameters())
        loss = sum(self._losses) / len(self._losses) if self._losses else None
        rec: Dict[str, Any] = dict(time=time.time(), step=step, quorum_id=m.quorum_id, participants=m.participants,
                   replica_rank=m.replica_rank, committed=committed, healed=m.healed_this_step,
                   heal_source=getattr(m, "heal_source", None) if m.healed_this_step else None,
                   loss=loss, step_time_s=time.time() - self._t0, param_checksum=checksum,
                   rode_out_outage=bool(getattr(m, "rode_out_outage", False)))  # ftbridge.manager.outage
        if self.cfg.slots:
            rec["units"] = [list(u) for u in self.slot_plan]
        self.events.write(**rec)
        aside = getattr(m, "stood_aside", None)
        if aside is not None:  # the group left the quorums after this step (ftbridge.manager.stand_aside)
            self.events.write(event="stand_aside", time=aside[0], step=step, seconds=aside[1])
        if rec["healed"] and self.manager.transport.last_recv:
            # Wall times of this heal's fetch, for the heal benchmark's phase split (ftbridge.harness.bench.heal).
            self.events.write(event="heal_transfer", step=step, **{k if k != "end" else "time": v for k, v in
                                                                   self.manager.transport.last_recv.items()})
        level = logging.INFO if committed else logging.WARNING
        samples_per_s = self.engine.train_batch_size() / max(rec["step_time_s"], 1e-9)
        why = "" if committed else f" ({self._discard_reason()})"
        self.log.log(level, "%s loss=%.4f participants=%d quorum=%d group samples/s=%.1f%s%s",
                     "committed" if committed else "DISCARDED", loss or float("nan"), rec["participants"],
                     rec["quorum_id"], samples_per_s,
                     " healed (the loss is of the state before the heal)" if rec["healed"] else "", why)

    def _discard_reason(self) -> str:
        """Why this step was discarded: the group's decision, or the first error recorded (one line)."""
        verdict = getattr(self.manager, "verdict", None)
        errored = self.manager.errored() if hasattr(self.manager, "errored") else None
        text = str(getattr(errored, "original_exception", errored) or "") or (
            verdict.decision.reason if verdict is not None else "")
        return (text.splitlines() or ["no reason recorded"])[0][:300]

    def _check_restart_had_peer(self, step: int) -> None:
        """Warn loudly when torchrun restarted this group but no live peer was there to heal from."""
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if attempt > 0 and self.manager.heals == 0 and step <= 1:
            self.log.error(
                "replica group restarted (torchrun attempt %d) but no live replica group had state to heal "
                "from: training starts again from the initial model at step 0. The other groups have "
                "finished or died too; resume from a checkpoint instead.", attempt)
            self.events.write(event="restart_without_peer", time=time.time(), step=step, attempt=attempt)

    # -- the state ftbridge adds to a replica ---------------------------------
    def replica_state(self) -> Dict[str, Any]:
        """What this rank holds beyond DeepSpeed's model, optimizer and scheduler; heals and checkpoints carry it.

        Returns:
            ``counters`` (DeepSpeed's step counters), ``window_start`` (``micro_steps`` at the current or next
            window's start), ``extra`` (:meth:`register_state` entries, wire form) and ``manager`` (torchft's).
        """
        e = self.engine
        return {
            "counters": {k: int(getattr(e, k)) for k in _COUNTERS},
            "window_start": self._window_start if self._in_step else int(e.micro_steps),
            "extra": self.extra.wire(),
            "manager": self.manager.state_dict(),
        }

    def load_replica_state(self, state: Dict[str, Any], *, manager: bool = True) -> None:
        """Apply a peer's or a checkpoint's :meth:`replica_state` on every rank of the group; with ``manager``, set
        torchft's counters too (a heal leaves them to torchft).

        Raises:
            ValueError: a registered state's keys or tensor shapes differ.
            KeyError: ``state`` lacks ``counters`` or ``window_start``.
        """
        e = self.engine
        for k in _COUNTERS:
            setattr(e, k, int(state["counters"][k]))
        into_window = int(e.micro_steps) - self._window_start if self._in_step else 0
        self._window_start = align_to_window(int(state["window_start"]), e.gradient_accumulation_steps())
        e.micro_steps = self._window_start + into_window
        self.extra.load(state.get("extra", {}))
        if manager and "manager" in state:
            self.manager.load_state_dict({k: int(v) for k, v in state["manager"].items()})

    # -- heal -------------------------------------------------------------
    def _prepare_heal_receive(self) -> None:
        """Joined with nothing: map the heal's receive buffer now and wait for quorums before forward."""
        transport: Any = getattr(self.manager, "transport", None)
        if self._joined_empty and hasattr(transport, "prepare_recv"):
            transport.prepare_recv()
            self._heal_first = True

            def first_commit(committed: bool) -> None:
                if committed and self._heal_first:
                    transport.release_recv()
                    self._heal_first = False

            self._step_hooks.append(first_commit)

    def heal_state(self) -> Dict[str, Any]:
        """This rank's state for a joiner, taken before the optimizer step: ZeRO partition and optimizer state,
        lr scheduler, :meth:`replica_state`."""
        e = self.engine
        state: Dict[str, Any] = {"optimizer": self.adapter.heal_state(), "replica": self.replica_state()}
        if e.lr_scheduler is not None and hasattr(e.lr_scheduler, "state_dict"):
            state["lr_scheduler"] = to_wire(e.lr_scheduler.state_dict())
        return state

    def heal_size_bound(self) -> int:
        """Largest heal body in bytes this rank accepts, optimizer state not created yet included; copies no tensor."""
        return size_bound(self.heal_state(), extra_bytes=lazy_state_bytes(self.adapter.optimizer))

    def load_heal_state(self, state: Dict[str, Any]) -> None:
        """Load a peer's :meth:`heal_state`; all ranks of the group call it together.

        Raises:
            ValueError: the peer's shapes or keys differ from this rank's.
        """
        e = self.engine
        self.adapter.load_heal_state(state["optimizer"])
        self.load_replica_state(state["replica"], manager=False)
        if "lr_scheduler" in state and e.lr_scheduler is not None:
            e.lr_scheduler.load_state_dict(from_wire(e.lr_scheduler.state_dict(), state["lr_scheduler"]))
        self.log.info("healed from a peer at step %d", self.manager.current_step)

    def shutdown(self) -> None:
        """Stop the manager and heal transport, close the event log."""
        self.manager.shutdown()
        if self.metrics is not None:
            self.metrics.close()
        self.events.close()
