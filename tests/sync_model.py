"""A model whose parameter use depends on the data, its data, and the torch reference of a job.

Shared by the property test's driver (``tests/integration/test_sync_property.py``)
and its workers (``tests/integration/workers/sync_worker.py``).

:class:`BranchNet` has a trunk every micro-batch uses and branches (each a
``Linear`` and a head) that a micro-batch uses only when its ``use`` list
names them, as MoE experts, task heads or conditional blocks do. A
:class:`JobSpec` says, per step, replica group and micro-batch, which
branches are used; the ranks of one group use the same ones (ZeRO-3 gathers
parameters collectively inside the group, so DeepSpeed itself needs that).

:func:`reference` computes, in plain torch, what every replica must hold
after the job: plain SGD on the average over replica groups and group ranks
of each rank's gradient, summed over the micro-batches of the step and
scaled by ``1 / gradient_accumulation_steps`` as DeepSpeed scales the loss
(under ``gradient_allreduce_op: sum``, the sum instead of the average).
A parameter no micro-batch of a group used contributes zero there.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Dict, List, Tuple

import torch


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """One randomised job (JSON-serialisable).

    Attributes:
        seed: initial parameters and data.
        d_in, hidden: trunk ``Linear(d_in, hidden)``.
        branch_sizes: branch ``k`` is ``Linear(hidden, branch_sizes[k])`` then a head ``Linear(., 1)``.
        bias: whether the trunk and branches have biases.
        groups, group_size: replica groups x ranks per group.
        steps: optimizer steps.
        micro: micro-batches per optimizer step (per rank).
        use: ``use[step][group][micro]`` is the list of branches that micro-batch uses.
        stage: ZeRO stage.
        pattern: how the caller ends an optimizer step: ``managed`` (``gradient_accumulation_steps=micro``,
            ``step()`` after every backward), ``manual`` (``set_gradient_accumulation_boundary``),
            ``unmanaged`` (``managed_gradient_accumulation: false``), ``coalesce``
            (``coalesce_grad_reduction``) or ``no_sync`` (all but the last backward inside
            ``engine.no_sync()``, ZeRO-1 only).
        gas: ``gradient_accumulation_steps`` in the DeepSpeed config (DeepSpeed divides the loss by it).
        sync_mode, message_bytes: ftbridge's ``sync_mode`` and ``cross_replica_bucket_bytes``.
        reduce_bucket_size, overlap_comm, contiguous_gradients: DeepSpeed ZeRO settings.
        offload: ``zero_optimization.offload_optimizer: {device: cpu}`` (the optimizer steps on the CPU).
        bf16: DeepSpeed's ``bf16`` mode (bf16 parameters and inputs, fp32 master weights).
        reduction: DeepSpeed's ``gradient_allreduce_op`` (``mean`` or ``sum``; ``sum`` not with ZeRO-3).
        lr: SGD learning rate.
        micro_batch: samples per micro-batch.
        slots: ftbridge's ``slots`` (0: off). With slots, ``use[step][slot][micro]`` names the branches of
            each unit of the grid (``slots`` x ``micro``), the groups compute the units
            :func:`ftbridge.slots.home_units` gives them (their counts differ when ``slots`` exceeds the
            groups) through ``engine.units()``, and the average is over ``slots x group_size`` ranks.
    """

    seed: int
    d_in: int
    hidden: int
    branch_sizes: Tuple[int, ...]
    bias: bool
    groups: int
    group_size: int
    steps: int
    micro: int
    use: Tuple[Tuple[Tuple[Tuple[int, ...], ...], ...], ...]
    stage: int
    pattern: str
    gas: int
    sync_mode: str
    message_bytes: int
    reduce_bucket_size: int
    overlap_comm: bool
    contiguous_gradients: bool
    offload: bool = False
    bf16: bool = False
    reduction: str = "mean"
    lr: float = 0.5
    micro_batch: int = 2
    slots: int = 0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "JobSpec":
        d = json.loads(text)
        d["branch_sizes"] = tuple(d["branch_sizes"])
        d["use"] = tuple(tuple(tuple(tuple(m) for m in g) for g in s) for s in d["use"])
        return cls(**d)

    def ds_config(self) -> Dict[str, Any]:
        """The DeepSpeed config of every replica group."""
        cfg: Dict[str, Any] = {
            "train_micro_batch_size_per_gpu": self.micro_batch, "gradient_accumulation_steps": self.gas,
            "gradient_clipping": 0.0, "steps_per_print": 10**9, "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": self.stage, "reduce_bucket_size": self.reduce_bucket_size,
                                  "overlap_comm": self.overlap_comm,
                                  "contiguous_gradients": self.contiguous_gradients},
        }
        if self.stage == 3:
            cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        if self.offload:  # a torch SGD on the CPU partition, not DeepSpeed's CPU Adam
            cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
            cfg["zero_force_ds_cpu_optimizer"] = False
        if self.pattern == "unmanaged":
            cfg["managed_gradient_accumulation"] = False
        if self.bf16:
            cfg["bf16"] = {"enabled": True}
        if self.reduction == "sum":
            cfg["gradient_allreduce_op"] = "sum"
        return cfg


class BranchNet(torch.nn.Module):
    """Trunk plus data-selected branches; ``forward(x, use)`` returns a scalar loss.

    Args:
        spec: sizes and seed.
    """

    def __init__(self, spec: JobSpec) -> None:
        super().__init__()
        torch.manual_seed(spec.seed)
        self.trunk = torch.nn.Linear(spec.d_in, spec.hidden, bias=spec.bias)
        self.branches = torch.nn.ModuleList(torch.nn.Linear(spec.hidden, h, bias=spec.bias)
                                            for h in spec.branch_sizes)
        self.heads = torch.nn.ModuleList(torch.nn.Linear(h, 1, bias=False) for h in spec.branch_sizes)

    def forward(self, x: torch.Tensor, use: List[int]) -> torch.Tensor:
        z = torch.tanh(self.trunk(x))
        loss = (z ** 2).mean()
        for k in use:
            loss = loss + self.heads[k](torch.tanh(self.branches[k](z))).mean()
        return loss


def batch(spec: JobSpec, step: int, group: int, rank: int, micro: int) -> torch.Tensor:
    """Input of one micro-batch, ``(micro_batch, d_in)`` float32, a pure function of its coordinates
    (``group`` is the slot when the job has slots)."""
    key = hashlib.sha256(f"{spec.seed}/{step}/{group}/{rank}/{micro}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") & (2**62 - 1))
    return torch.randn(spec.micro_batch, spec.d_in, generator=g)


def reference(spec: JobSpec) -> Dict[str, torch.Tensor]:
    """The parameters every replica must hold after the job, computed directly in torch (float64)."""
    model = BranchNet(spec).double()
    params = dict(model.named_parameters())
    for s in range(spec.steps):
        model.zero_grad(set_to_none=True)
        for g in range(spec.slots or spec.groups):  # with slots, g is the slot
            for r in range(spec.group_size):
                for m in range(spec.micro):
                    loss = model(batch(spec, s, g, r, m).double(), list(spec.use[s][g][m])) / spec.gas
                    loss.backward()
        with torch.no_grad():
            for p in params.values():
                if p.grad is not None:
                    ranks = (spec.slots or spec.groups) * spec.group_size if spec.reduction == "mean" else 1
                    p.sub_(spec.lr * p.grad / ranks)
    return {k: v.detach().float() for k, v in params.items()}
