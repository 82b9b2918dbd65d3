"""PowerSGD on a ZeRO gradient partition, fault tolerant across replica groups.

Algorithm: Vogels, Karimireddy, Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
Optimization", NeurIPS 2019: one step of power iteration per optimizer step, warm-started from the previous
step's Q, with error feedback. Follows PyTorch's ``torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py``
(``PowerSGDState``, ``powerSGD_hook``, ``batched_powerSGD_hook``) and keeps its option names and defaults. Per
step, for each gradient matrix ``M`` (``n x m``) of the partition, rank ``r``:

1. ``M += e`` (error feedback); ``Q`` = last step's Q or random; orthogonalise ``Q``; ``P = M Q``;
2. average ``P`` (one message, with the uncompressed elements); orthogonalise ``P``;
3. ``Q = M^T P``; average ``Q`` (second message);
4. ``M = P Q^T`` (the same on every replica); ``e = M_in - M``.

``iter`` counts committed steps; the new Q, error buffer and ``iter`` apply only on commit; a heal ships Q,
``iter`` and ``random_seed``, not the error buffer. The differences from PyTorch and their reasons:
docs/comm_hooks.md, "PowerSGD on ZeRO partitions" and "PowerSGD state across membership changes".
"""

from __future__ import annotations

import logging
import math
from typing import Any, Dict, List, Optional, Tuple

import torch

from ftbridge.comm_hooks.base import LOW_PRECISION, ChainWork, CommHookState
from ftbridge.comm_hooks.matrices import Matrix, split
from ftbridge.zero.layout import PartitionLayout

logger = logging.getLogger(__name__)

_TINY = 1e-30


class PowerSGDState(CommHookState):
    """PowerSGD options (PyTorch's names) and the state that must survive membership changes.

    Args:
        manager: the rank's replica manager.
        reduction: ``"mean"`` or ``"sum"`` (:class:`~ftbridge.comm_hooks.base.CommHookState`), for P and Q alike.
        batched: ``batched_power_sgd`` (one square matrix per partition).
        matrix_approximation_rank: rank ``r`` of the approximation.
        start_powerSGD_iter: committed steps of plain averaging before compressing.
        min_compression_rate: compress a matrix only if ``n m / ((n + m) r)`` exceeds it.
        use_error_feedback: add last step's compression error to the gradient.
        warm_start: start from last step's Q instead of a random one.
        orthogonalization_epsilon: added to column norms in Gram-Schmidt.
        random_seed: seed of the random Q (with the step).
        batch_tensors_with_same_shape: one batched matmul per shape.
    """

    needs_partition = True

    def __init__(self, manager: Any, *, reduction: str = "mean", batched: bool = False,
                 matrix_approximation_rank: int = 1, start_powerSGD_iter: int = 1_000,
                 min_compression_rate: float = 2.0, use_error_feedback: bool = True, warm_start: bool = True,
                 orthogonalization_epsilon: float = 0.0, random_seed: int = 0,
                 batch_tensors_with_same_shape: bool = False) -> None:
        super().__init__(manager, reduction)
        self.batched = batched
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.random_seed = random_seed
        self.batch_tensors_with_same_shape = batch_tensors_with_same_shape
        self.iter = 0
        """Committed steps seen by this hook (shared: a joiner receives it)."""
        self.q: Optional[torch.Tensor] = None
        """Last committed Q of every matrix, flat fp32 on the CPU (shared; warm start)."""
        self.error: Optional[torch.Tensor] = None
        """Local error-feedback buffer over the compressed elements (not shared)."""
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0
        self._pending: Optional[Dict[str, Any]] = None
        self._healed = False
        self._plan: Optional[_Plan] = None

    # -- plan ---------------------------------------------------------------
    def plan(self, numel: int) -> "_Plan":
        """Matrices, uncompressed spans and factor sizes for a partition of ``numel`` elements."""
        if self._plan is None or self._plan.numel != numel:
            layout = self.layout
            if self.batched:
                self._plan = _Plan.square(numel, self.matrix_approximation_rank)
            else:
                if layout is None or layout.numel != numel:
                    raise ValueError(
                        f"power_sgd needs the partition layout of {numel} elements, have "
                        f"{None if layout is None else layout.numel}; use comm_hook='batched_power_sgd'")
                self._plan = _Plan.from_layout(layout, self.matrix_approximation_rank, self.min_compression_rate,
                                               self.batch_tensors_with_same_shape)
        return self._plan

    def compression_stats(self) -> Tuple[float, int, int]:
        """``(rate, elements before, elements after)`` over the compressed steps so far (PyTorch's)."""
        after = self.total_numel_after_compression
        return (self.total_numel_before_compression / after if after else 0.0,
                self.total_numel_before_compression, after)

    # -- step outcome ---------------------------------------------------------
    def commit(self) -> None:
        """Apply this step's new Q, error buffer and iteration count."""
        p, self._pending = self._pending, None
        if p is not None:
            self.iter = p["step"] + 1
            if p.get("q") is not None:
                self.q = p["q"] if self.warm_start else None
            if "error" in p:
                self.error = None if self._healed else p["error"]
        self._healed = False

    def discard(self) -> None:
        """Forget this step's changes: Q, error buffer and ``iter`` stay as they were."""
        self._pending = None
        self._healed = False

    # -- heal -----------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Shared state: ``iter``, ``random_seed``, and Q (zeros with ``has_q`` false before the first)."""
        size = self._q_numel()
        q = self.q if self.q is not None and self.q.numel() == size else torch.zeros(size)
        return {"iter": int(self.iter), "random_seed": int(self.random_seed), "has_q": self.q is not None,
                "q": q.detach().clone()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Take a peer's shared state; the local error buffer restarts at zero."""
        if int(state["random_seed"]) != self.random_seed:
            raise ValueError(f"peer's PowerSGD random_seed={state['random_seed']} differs from ours "
                             f"({self.random_seed}); run every replica group with the same comm_state_option")
        self.iter = int(state["iter"])
        self.q = state["q"].detach().float().cpu().clone() if state["has_q"] else None
        self.error = None
        self._healed = True

    def describe(self) -> Dict[str, Any]:
        """``comm_hook_iter``, ``comm_hook_q_checksum`` (of the shared Q) and the compression rate."""
        from ftbridge.events import tensor_checksum

        return {"comm_hook_iter": int(self.iter),
                "comm_hook_q_checksum": tensor_checksum([self.q]) if self.q is not None else None,
                "comm_hook_compression_rate": self.compression_stats()[0]}

    def _q_numel(self) -> int:
        if self.layout is None:
            return 0
        return self.plan(self.layout.numel).q_numel


class _Plan:
    """Where each matrix and uncompressed span sits, and the P/Q buffer offsets."""

    def __init__(self, numel: int, matrices: List[Matrix], plain: List[Tuple[int, int]],
                 groups: List[List[int]], rank: int) -> None:
        self.numel = numel
        self.matrices, self.plain, self.groups = matrices, plain, groups
        self.ranks = [min(matrices[g[0]].rows, matrices[g[0]].cols, rank) for g in groups]
        self.plain_numel = sum(n for _, n in plain)
        self.p_numel = sum(len(g) * matrices[g[0]].rows * r for g, r in zip(groups, self.ranks))
        self.q_numel = sum(len(g) * matrices[g[0]].cols * r for g, r in zip(groups, self.ranks))
        self.compressed_numel = sum(m.numel for m in matrices)

    @classmethod
    def from_layout(cls, layout: PartitionLayout, rank: int, min_rate: float, batch_same_shape: bool) -> "_Plan":
        matrices, plain = split(layout, rank, min_rate)
        groups: List[List[int]] = []
        if batch_same_shape:
            by_shape: Dict[Tuple[int, int], List[int]] = {}
            for i, m in enumerate(matrices):
                by_shape.setdefault((m.rows, m.cols), []).append(i)
            groups = list(by_shape.values())
        else:
            groups = [[i] for i in range(len(matrices))]
        return cls(layout.numel, matrices, plain, groups, rank)

    @classmethod
    def square(cls, numel: int, rank: int) -> "_Plan":
        side = max(1, math.ceil(math.sqrt(numel)))
        return cls(numel, [Matrix(0, side, side)], [], [[0]], rank)


def _random_q(state: PowerSGDState, step: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A random Q on the CPU (as PyTorch, so every device draws the same), from (random_seed, step)."""
    g = torch.Generator().manual_seed((state.random_seed * 1_000_003 + step) % (2 ** 63))
    return torch.randn(numel, generator=g, dtype=torch.float32).to(dtype)


def orthogonalize(matrices: torch.Tensor, epsilon: float = 0.0) -> None:
    """Orthonormalise, in place, each ``(n, r)`` matrix of a ``(b, n, r)`` batch (Gram-Schmidt or QR, as PyTorch)."""
    rank = matrices.shape[2]
    if rank > 2 and matrices.dtype not in LOW_PRECISION:
        matrices.copy_(torch.linalg.qr(matrices).Q)
        return
    for i in range(rank):
        col = matrices[:, :, i:i + 1]
        norm = torch.linalg.vector_norm(col.float(), dim=1, keepdim=True)
        norm = norm + epsilon if epsilon else norm.clamp_min(_TINY)
        col.div_(norm.to(col.dtype))
        if i + 1 < rank:
            rest = matrices[:, :, i + 1:]
            rest.sub_((col * rest).sum(dim=1, keepdim=True) * col)


def powerSGD_hook(state: PowerSGDState, tensor: torch.Tensor) -> Any:
    """PowerSGD of each parameter fragment of the flat partition ``tensor`` (in place); plain averaging for the
    first ``start_powerSGD_iter`` committed steps.

    Args:
        state: the rank's :class:`PowerSGDState` (its ``layout`` set).
        tensor: the rank's whole flat gradient partition, fp32/fp16/bf16.

    Returns:
        Work; after ``wait()`` ``tensor`` holds the approximated average.

    Raises:
        ValueError: ``tensor`` is not the partition the layout describes.
    """
    return _power_sgd(state, tensor)


def batched_powerSGD_hook(state: PowerSGDState, tensor: torch.Tensor) -> Any:
    """PowerSGD of the whole flat partition as one zero-padded square matrix; as :func:`powerSGD_hook`, no layout."""
    return _power_sgd(state, tensor)


def _power_sgd(state: PowerSGDState, tensor: torch.Tensor) -> Any:
    step = state.step
    if step < state.start_powerSGD_iter:
        state._pending = {"step": step}
        return state.allreduce(tensor)
    return _Step(state, tensor, step).start()


class _Step:
    """One PowerSGD step on one partition: P message, then Q message, then decompression."""

    def __init__(self, state: PowerSGDState, tensor: torch.Tensor, step: int) -> None:
        self.state, self.tensor, self.step = state, tensor, step
        self.plan = plan = state.plan(tensor.numel())
        dtype = tensor.dtype
        self.source = tensor
        if state.batched:  # the square matrix is a zero-padded copy
            side = plan.matrices[0].rows
            self.source = tensor.new_zeros(side * side)
            self.source[:tensor.numel()].copy_(tensor)
        self.mats = [self.source.narrow(0, m.offset, m.numel).view(m.rows, m.cols) for m in plan.matrices]
        state.total_numel_before_compression += tensor.numel()
        state.total_numel_after_compression += plan.plain_numel + plan.p_numel + plan.q_numel
        self.m_in = self._add_error() if state.use_error_feedback and self.mats else None
        self.batches = [self.mats[g[0]].unsqueeze(0) if len(g) == 1 else torch.stack([self.mats[i] for i in g])
                        for g in plan.groups]
        if state.warm_start and state.q is not None and state.q.numel() == plan.q_numel:
            self.q = state.q.to(device=tensor.device, dtype=dtype, copy=True)
        else:
            self.q = _random_q(state, step, plan.q_numel, dtype).to(tensor.device)
        self.first = tensor.new_empty(plan.plain_numel + plan.p_numel)
        self.ps, self.qs = _factor_views(plan, self.first, plan.plain_numel, self.q)

    def _add_error(self) -> torch.Tensor:
        """``M += e`` for every compressed matrix; returns the flat ``M_in`` for the next error."""
        err = self.state.error
        n = self.plan.compressed_numel
        if err is None or err.numel() != n or err.dtype != self.tensor.dtype:
            err = self.tensor.new_zeros(n)
        offset = 0
        for m in self.mats:
            m.add_(err[offset:offset + m.numel()].view_as(m))
            offset += m.numel()
        return torch.cat([m.reshape(-1) for m in self.mats])

    def start(self) -> Any:
        """``P = M Q`` and the first message: uncompressed elements and P, averaged."""
        offset = 0
        for off, n in self.plan.plain:
            self.first[offset:offset + n].copy_(self.tensor[off:off + n])
            offset += n
        for m, p, q in zip(self.batches, self.ps, self.qs):
            orthogonalize(q, self.state.orthogonalization_epsilon)
            torch.bmm(m, q, out=p)
        return ChainWork(self.state.allreduce(self.first), self.compute_q)

    def compute_q(self) -> Any:
        """Unpack the uncompressed elements; ``Q = M^T orth(P)`` and the second message."""
        offset = 0
        for off, n in self.plan.plain:
            self.tensor[off:off + n].copy_(self.first[offset:offset + n])
            offset += n
        for m, p, q in zip(self.batches, self.ps, self.qs):
            orthogonalize(p, self.state.orthogonalization_epsilon)
            torch.bmm(m.transpose(1, 2), p, out=q)
        return ChainWork(self.state.allreduce(self.q), self.decompress)

    def decompress(self) -> None:
        """``M = P Q^T``; keep the new Q and error aside until the step commits."""
        for g, p, q in zip(self.plan.groups, self.ps, self.qs):
            approx = torch.bmm(p, q.transpose(1, 2))
            for j, i in enumerate(g):
                self.mats[i].copy_(approx[j])
        pending: Dict[str, Any] = {"step": self.step, "q": self.q.float().cpu()}
        if self.m_in is not None:
            pending["error"] = self.m_in - torch.cat([m.reshape(-1) for m in self.mats])
        if self.state.batched:
            self.tensor.copy_(self.source[:self.tensor.numel()])
        self.state._pending = pending


def _factor_views(plan: _Plan, p_buf: torch.Tensor, p_start: int,
                  q_buf: torch.Tensor) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    ps, qs = [], []
    p_off, q_off = p_start, 0
    for g, r in zip(plan.groups, plan.ranks):
        m = plan.matrices[g[0]]
        b = len(g)
        ps.append(p_buf.narrow(0, p_off, b * m.rows * r).view(b, m.rows, r))
        qs.append(q_buf.narrow(0, q_off, b * m.cols * r).view(b, m.cols, r))
        p_off += b * m.rows * r
        q_off += b * m.cols * r
    return ps, qs
