"""Cross-replica averaging of the ZeRO gradient partition: exact for any set of gradients.

:class:`GradientSync` averages each rank's reduced gradient partition with the same group rank's in the other
replica groups, before DeepSpeed's overflow check, norm and clipping. The messages (:mod:`ftbridge.zero.messages`)
are the same on every replica and go in plan order, each as early as its content is final, through a
communication hook (:mod:`ftbridge.comm_hooks`); a hook that raises discards the step on every replica.
Why: docs/concepts.md, "Where the sync sits in a ZeRO step" and "Optimizer offload".
"""

from __future__ import annotations

import logging
from typing import Any, Callable, List, Optional, Tuple

import torch

from ftbridge.comm_hooks.base import CastBackWork, CommHookState, wait_result
from ftbridge.comm_hooks.default import allreduce_hook
from ftbridge.config_rules import SYNC_MODES
from ftbridge.manager import ReplicaManager
from ftbridge.zero.adapter import ZeroAdapter
from ftbridge.zero.engine_points import check_accumulation_settings
from ftbridge.zero.messages import Message, Readiness, plan_messages
from ftbridge.zero.stages import adapter_for
from ftbridge.zero.stream_order import StreamOrder

logger = logging.getLogger(__name__)


class GradientSync:
    """Average the rank's gradient partition across replica groups, in layout-defined messages.

    Per optimizer step the engine calls :meth:`begin_backward` and :meth:`end_backward` around every
    backward, :meth:`wait` right before DeepSpeed's optimizer step, then :meth:`commit` or :meth:`reset`.

    Args:
        manager, adapter: the rank's replica manager, and where the partition lives for this ZeRO stage.
        mode, min_bytes: as ``FTBridgeConfig.sync_mode`` and ``cross_replica_bucket_bytes``.
        hook: ``hook(state, flat) -> work`` (:mod:`ftbridge.comm_hooks`); default the plain average.
        hook_state: its state; default a :class:`CommHookState` of ``manager``.
        order: ordering against DeepSpeed's CUDA streams (:mod:`ftbridge.zero.stream_order`); default: on GPU.

    Raises:
        ValueError: ``mode`` is not in :data:`SYNC_MODES`, or ``min_bytes < 0``.
    """

    def __init__(self, manager: ReplicaManager, adapter: ZeroAdapter, mode: str = "per_bucket",
                 min_bytes: int = 25 << 20, hook: Optional[Callable[..., Any]] = None,
                 hook_state: Optional[CommHookState] = None, order: Optional[StreamOrder] = None) -> None:
        if mode not in SYNC_MODES:
            raise ValueError(f"sync mode {mode!r}: use one of {', '.join(SYNC_MODES)}")
        if min_bytes < 0:
            raise ValueError(f"min_bytes={min_bytes} must be >= 0")
        self.manager = manager
        self.hook = hook or allreduce_hook
        self.hook_state = hook_state if hook_state is not None else CommHookState(manager)
        self._pending: List[Tuple[Any, torch.Tensor, Any]] = []
        self.adapter = adapter
        self.order = order if order is not None else StreamOrder(adapter.on_cuda)
        self.mode = mode
        self.min_bytes = min_bytes
        self.fallback_reason = ""
        """Why per-bucket issue never runs on this optimizer ("" when it can)."""
        self.plan: List[Message] = []
        self.issued_in_backward = 0
        """Messages issued inside backward so far (the overlapped ones), summed over steps."""
        self._readiness: Optional[Readiness] = None
        self._armed = False
        self._next = 0
        self._logged: set = set()

    @property
    def bytes_sent(self) -> int:
        """Bytes handed to the cross-replica all-reduce so far (payload, not wire bytes)."""
        return self.hook_state.bytes_sent

    @property
    def allreduces(self) -> int:
        """Cross-replica all-reduce calls so far."""
        return self.hook_state.allreduces

    def _start(self, flat: torch.Tensor, tag: Any = None) -> None:
        """Start averaging 1-D ``flat`` in place; ``tag`` comes back with the result in :meth:`_wait_pending`."""
        try:
            if getattr(self.manager, "backend", "gloo") == "nccl" and not flat.is_cuda:
                # ZeRO-1/2 optimizer offload keeps the partition on the CPU, which NCCL cannot move: through
                # this rank's GPU and back (the copy back happens at wait, on the sync stream).
                on_gpu = flat.to(torch.device("cuda", torch.cuda.current_device()), non_blocking=False)
                work = CastBackWork(self.hook(self.hook_state, on_gpu), on_gpu, flat)
            else:
                if tag is not None:  # a copy of the gradients, read again only after a successful wait
                    self.hook_state.lend(flat)
                work = self.hook(self.hook_state, flat)
        except Exception as e:  # a hook's failure discards the step, like a failed all-reduce
            logger.exception("communication hook %s failed; the step will be discarded",
                             getattr(self.hook, "__name__", self.hook))
            self.manager.report_error(e)
            return
        self._pending.append((work, flat, tag))

    def _wait_pending(self, on_result: Optional[Callable[[torch.Tensor, Any], None]] = None) -> None:
        """Wait for every pending all-reduce; ``on_result(flat, tag)`` for tagged ones. Failures discard the step."""
        pending, self._pending = self._pending, []
        for work, flat, tag in pending:
            try:
                done = wait_result(work, flat)
            except Exception as e:
                logger.exception("communication hook work failed; the step will be discarded")
                self.manager.report_error(e)
                continue
            if done and tag is not None and on_result is not None:
                on_result(flat, tag)

    def commit(self) -> None:
        """The step committed on every replica: the hook applies its state changes."""
        self.hook_state.end_step()
        self.hook_state.commit()

    # -- install -----------------------------------------------------------
    def install(self) -> None:
        """Cut the message plan and, in per-bucket mode, wrap DeepSpeed's bucket point."""
        layout = self.adapter.partition_layout()
        if self.hook_state.needs_partition:
            self.hook_state.layout = layout  # PowerSGD: the whole partition, with its fragments
        per_bucket = self.mode == "per_bucket"
        if per_bucket and self.hook_state.needs_partition:
            self.fallback_reason = (f"communication hook {getattr(self.hook, '__name__', self.hook)} needs the "
                                    "whole partition and its fragment layout")
        elif per_bucket:
            self.fallback_reason = self.adapter.per_bucket_unsupported(layout)
        one_message = not per_bucket or bool(self.fallback_reason)
        element = self.adapter.grad_element_size()
        self.plan = plan_messages(layout, layout.numel if one_message else -(-self.min_bytes // element))
        if self.fallback_reason:
            logger.warning("per-bucket cross-replica sync unavailable (%s); one all-reduce after backward",
                           self.fallback_reason)
        elif per_bucket:
            self._readiness = Readiness(self.plan)
            self.adapter.wrap_bucket_point(self._on_reduced)
            logger.info("per-bucket cross-replica all-reduce installed: %d messages per step", len(self.plan))

    # -- per step ------------------------------------------------------------
    def begin_backward(self, *, boundary: bool, first: bool, no_sync: bool) -> None:
        """Before a backward: arm per-bucket issue if this backward completes the gradient exactly. ``boundary``: the
        accumulation boundary; ``first``: the window's first backward; ``no_sync``: DeepSpeed defers the reduction."""
        self._armed = False
        if boundary and not no_sync:
            self.order.begin()
        if self._readiness is None or not boundary or no_sync:
            return
        reason = self.adapter.window_not_exact(first)
        if reason:
            self._log_once(reason)
            return
        self._readiness.reset()
        self._armed = True

    def end_backward(self, *, boundary: bool, no_sync: bool) -> None:
        """After a backward: at the boundary, issue every message not issued yet."""
        self._armed = False
        if boundary and not no_sync:
            self._issue_rest()

    def wait(self) -> None:
        """Right before the optimizer step: issue what is left, wait, put results in the partition.

        Never raises: torchft records a failure and the step is discarded.
        """
        self._issue_rest()
        had_work = bool(self._pending)
        with self.order.waiting():  # on the stream the work was issued on (torchft asserts it)
            if any(tag is not None for _, _, tag in self._pending):
                canon = CanonicalPartition(self.adapter.partition_grads())
                self._wait_pending(lambda flat, m: canon.scatter(m.start, flat))
            else:
                self._wait_pending()
        if had_work:  # DeepSpeed's streams may write its buffers only after the all-reduces finished
            self.order.release(self.adapter.side_streams())
        self._next = 0

    def reset(self) -> None:
        """Forget pending work (after a discarded step); the hook forgets its state changes."""
        self._pending = []
        self.hook_state.end_step()
        self.hook_state.discard()
        self._next = 0
        self._armed = False

    @property
    def issued(self) -> int:
        """Messages of the current window issued so far."""
        return self._next

    # -- internals -----------------------------------------------------------
    def _on_reduced(self, keys: List[int]) -> None:
        """DeepSpeed reduced these parameters' gradients in the group (called by the bucket point)."""
        if not self._armed or self._readiness is None:  # armed only with a readiness tracker
            return
        ready = self._readiness.reduced(keys)
        if not ready:
            return
        # After the stream that reduced this bucket, on the sync stream (ftbridge.zero.stream_order).
        with self.order.issuing(self.order.fence(self.adapter.bucket_stream())):
            for k in ready:
                self._issue(k, in_backward=True)

    def _issue_rest(self) -> None:
        start = self.issued
        if self._readiness is not None:
            self._readiness.rest()
        if start < len(self.plan):
            if start == 0:
                self.adapter.assemble_partition()
            canon = CanonicalPartition(self.adapter.partition_grads())
            with self.order.issuing(self.order.fence_all(self.adapter.side_streams())):
                for k in range(start, len(self.plan)):
                    self._issue(k, in_backward=False, canon=canon)

    def _issue(self, k: int, *, in_backward: bool, canon: Optional["CanonicalPartition"] = None) -> None:
        if k != self.issued:
            raise AssertionError(f"message {k} issued out of order (next is {self.issued})")
        self._next = k + 1
        m = self.plan[k]
        if in_backward:
            flat, copied = self.adapter.gather_reduced(m)
            self.issued_in_backward += 1
        else:
            assert canon is not None
            flat, copied = canon.gather(m.start, m.end)
        self._start(flat, m if copied else None)

    def _log_once(self, reason: str) -> None:
        if reason not in self._logged:
            self._logged.add(reason)
            logger.warning("per-bucket cross-replica sync not exact this step (%s): its messages go after "
                           "backward instead (logged once)", reason)


class CanonicalPartition:
    """The tensors ``optimizer.step()`` reads (:meth:`ZeroAdapter.partition_grads`), as one flat range of elements."""

    def __init__(self, tensors: List[torch.Tensor]) -> None:
        self.tensors = [t for t in tensors if t.numel() > 0]
        self.offsets, off = [], 0
        for t in self.tensors:
            self.offsets.append(off)
            off += t.numel()
        self.numel = off

    def _pieces(self, start: int, end: int) -> List[Tuple[torch.Tensor, int, int, int]]:
        """``(tensor, from, to, at)``: elements ``[from, to)`` of ``tensor`` sit at ``at`` of the range."""
        if not 0 <= start <= end <= self.numel:
            raise ValueError(f"range [{start}, {end}) outside the partition of {self.numel} elements")
        out = []
        for off, t in zip(self.offsets, self.tensors):
            a, b = max(start, off), min(end, off + t.numel())
            if a < b:
                out.append((t, a - off, b - off, a - start))
        return out

    def gather(self, start: int, end: int) -> Tuple[torch.Tensor, bool]:
        """Elements ``[start, end)`` as one 1-D tensor, and whether it is a copy (else a view, in place)."""
        pieces = self._pieces(start, end)
        if len(pieces) == 1 and pieces[0][0].is_contiguous():
            t, a, b, _ = pieces[0]
            return t.view(-1)[a:b], False
        dtype = self.tensors[0].dtype if self.tensors else torch.float32
        device = self.tensors[0].device if self.tensors else "cpu"
        flat = torch.empty(end - start, dtype=dtype, device=device)
        for t, a, b, at in pieces:
            flat[at:at + b - a].copy_(t.reshape(-1)[a:b])
        return flat, True

    def scatter(self, start: int, flat: torch.Tensor) -> None:
        """Write 1-D ``flat`` over elements ``[start, start + numel)``."""
        for t, a, b, at in self._pieces(start, start + flat.numel()):
            src = flat[at:at + b - a]
            if t.is_contiguous():
                t.view(-1)[a:b].copy_(src)
            else:
                whole = t.reshape(-1).clone()
                whole[a:b].copy_(src)
                t.copy_(whole.view_as(t))


def checked_adapter(engine: Any) -> ZeroAdapter:
    """The ZeRO adapter of ``engine``, after refusing every setting ftbridge cannot make exact; call it first.

    Raises:
        ValueError: ZeRO stage 0, or a feature, optimizer path or accumulation setting that cannot be exact
            (:meth:`ZeroAdapter.unsupported`, :meth:`ZeroAdapter.accumulation_refused`), naming the fix.
    """
    adapter = adapter_for(engine)
    check_accumulation_settings(engine)
    refused = adapter.unsupported()
    if refused:
        raise ValueError(refused)
    refused = adapter.accumulation_refused()
    if engine.gradient_accumulation_steps() > 1 and refused:
        raise ValueError(f"gradient_accumulation_steps={engine.gradient_accumulation_steps()}: {refused}")
    return adapter


def build_sync(adapter: ZeroAdapter, manager: ReplicaManager, sync_mode: str, min_bytes: int,
               hook: Optional[Callable[..., Any]] = None,
               hook_state: Optional[CommHookState] = None) -> GradientSync:
    """The installed cross-replica sync of ``adapter``'s optimizer (per bucket where :meth:`GradientSync.install`
    allows)."""
    sync = GradientSync(manager, adapter, sync_mode, min_bytes=min_bytes, hook=hook, hook_state=hook_state)
    sync.install()
    return sync

