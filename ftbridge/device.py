"""Where one rank computes, and which backends its process groups use: decided once, before any work.

:func:`probe` reads the machine; the decisions are pure: :func:`resolve_device`, :func:`in_group_backend`,
:func:`cross_replica_backend`; :func:`check_placement` runs them all. Every rank of a job must decide alike.
Why: docs/gpu.md, "The backend choice".
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from typing import Any, Iterable, List, Mapping, Optional, Tuple

from ftbridge.config import FTBridgeConfig
from ftbridge.config_rules import CROSS_REPLICA_BACKENDS

DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class Machine:
    """What this process can see of the machine.

    Attributes:
        cuda_available: ``torch.cuda.is_available()``.
        visible_gpus: GPUs this process may use (after ``CUDA_VISIBLE_DEVICES``).
        physical_gpus: GPUs of the machine (NVML, ignoring ``CUDA_VISIBLE_DEVICES``; else ``visible_gpus``).
    """

    cuda_available: bool
    visible_gpus: int
    physical_gpus: int


def probe() -> Machine:
    """Read :class:`Machine` for this process (initialises CUDA only if present)."""
    import torch

    if not torch.cuda.is_available():
        return Machine(False, 0, 0)
    visible = torch.cuda.device_count()
    try:
        physical = int(torch.cuda._raw_device_count_nvml())  # the count before CUDA_VISIBLE_DEVICES
    except Exception:  # noqa: BLE001 - NVML missing: fall back to what is visible
        physical = -1
    return Machine(True, visible, physical if physical > 0 else visible)


def resolve_device(requested: str, machine: Machine, local_rank: int) -> str:
    """The device of this rank: ``"cpu"`` or ``"cuda:N"``.

    Args:
        requested: ``auto`` (CUDA when available), ``cpu`` or ``cuda``.
        machine: :func:`probe`'s result.
        local_rank: this rank's index on its node within its replica group (``LOCAL_RANK``).

    Raises:
        ValueError: ``requested`` is none of :data:`DEVICES`; ``cuda`` without a visible GPU; more ranks of
            this group on this node than visible GPUs.
    """
    if requested not in DEVICES:
        raise ValueError(f"device={requested!r} is not one of {DEVICES}")
    if requested == "cpu" or (requested == "auto" and not machine.cuda_available):
        return "cpu"
    if not machine.cuda_available or machine.visible_gpus < 1:
        raise ValueError("device=cuda but torch sees no CUDA GPU (torch.cuda.is_available() is False: no GPU, no "
                         "driver, a CPU-only torch build, or CUDA_VISIBLE_DEVICES empty); use --device cpu or auto")
    if not 0 <= local_rank < machine.visible_gpus:
        raise ValueError(f"local rank {local_rank} has no GPU of its own: {machine.visible_gpus} visible GPU(s) on "
                         "this node, and the ranks of one replica group need one GPU each (NCCL); launch at most "
                         f"{machine.visible_gpus} ranks per node (--nproc-per-node) or use --device cpu")
    return f"cuda:{local_rank}"


def in_group_backend(device_type: str) -> str:
    """torch.distributed backend of the replica group's own world for ``device_type`` (``cuda`` or ``cpu``)."""
    return "nccl" if device_type == "cuda" else "gloo"


def gpus_shared(*, single_host: bool, num_replica_groups: int, local_group_size: int, physical_gpus: int) -> bool:
    """Whether groups share GPUs: ``single_host`` and ``physical_gpus < num_replica_groups * local_group_size``."""
    return single_host and num_replica_groups * max(1, local_group_size) > physical_gpus


def cross_replica_backend(requested: str, *, on_cuda: bool, shared: bool) -> str:
    """Backend of torchft's cross-replica process group: ``"nccl"`` or ``"gloo"`` (pure).

    Args:
        requested: ``auto``, ``nccl`` or ``gloo`` (``FTBridgeConfig.cross_replica_backend``).
        on_cuda: the model (so the gradient partition) is on a GPU.
        shared: :func:`gpus_shared`.

    Raises:
        ValueError: ``nccl`` for a model on the CPU, or for ranks that share a GPU.
    """
    if requested not in CROSS_REPLICA_BACKENDS:
        raise ValueError(f"cross_replica_backend={requested!r} is not one of {CROSS_REPLICA_BACKENDS}")
    if not on_cuda:
        if requested == "nccl":
            raise ValueError("cross_replica_backend=nccl but the model is on the CPU: NCCL moves only GPU tensors; "
                             "use auto or gloo (FTBRIDGE_CROSS_REPLICA_BACKEND)")
        return "gloo"
    if requested == "auto":
        return "gloo" if shared else "nccl"
    if requested == "nccl" and shared:
        raise ValueError("cross_replica_backend=nccl but ranks of different replica groups share a GPU on this "
                         "machine (fewer GPUs than ranks), and NCCL cannot run two ranks of one communicator on one "
                         "GPU: use auto or gloo, or give every rank its own GPU")
    return requested


def is_loopback(host: str) -> bool:
    """Whether ``host`` (IP literal, bracketed or not, or name) is loopback; names other than localhost: ``False``."""
    bare = host.strip("[]")
    if bare.lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(bare).is_loopback
    except ValueError:
        return False


def local_rank(environ: Optional[Mapping[str, str]] = None) -> int:
    """``LOCAL_RANK`` from torchrun (0 when unset)."""
    env = os.environ if environ is None else environ
    return int(env.get("LOCAL_RANK", "0") or 0)


def backend_for(cfg: FTBridgeConfig, *, on_cuda: bool, machine: Optional[Machine] = None) -> str:
    """:func:`cross_replica_backend` for ``cfg`` on this machine (probes GPUs only when ``on_cuda``)."""
    shared = False
    if on_cuda:
        machine = machine or probe()
        shared = gpus_shared(single_host=is_loopback(cfg.heal_bind), num_replica_groups=cfg.num_replica_groups,
                             local_group_size=cfg.local_group_size or cfg.group_size,
                             physical_gpus=machine.physical_gpus)
    return cross_replica_backend(cfg.cross_replica_backend, on_cuda=on_cuda, shared=shared)


def check_placement(model_devices: Iterable[str], accelerator: str, cfg: FTBridgeConfig, *,
                    machine: Optional[Machine] = None, rank_on_node: Optional[int] = None) -> Tuple[str, str, str]:
    """Check where ``ftbridge.initialize`` will train, before any process group or engine exists.

    Args:
        model_devices: device types of the model's parameters (``"cpu"``, ``"cuda"``).
        accelerator: DeepSpeed's accelerator name (``cuda`` or ``cpu``), which places the model.
        cfg: resolved settings (``cross_replica_backend``, topology).
        machine: :func:`probe`'s result (probed when ``None`` and needed).
        rank_on_node: ``LOCAL_RANK`` (from the environment when ``None``).

    Returns:
        ``(device, in-group backend, cross-replica backend)``, e.g. ``("cuda:1", "nccl", "gloo")``.

    Raises:
        ValueError: parameters on a GPU under ``DS_ACCELERATOR=cpu``; a CUDA accelerator without a
            GPU for this rank; a cross-replica backend that cannot work.
    """
    kinds = set(model_devices)
    if accelerator != "cuda" and kinds - {"cpu", "meta"}:
        raise ValueError(f"the model has parameters on {sorted(kinds)} but DeepSpeed's accelerator is "
                         f"{accelerator!r} (DS_ACCELERATOR?), which would train on the CPU: unset DS_ACCELERATOR "
                         "or set it to cuda, or keep the model on the CPU")
    device = "cpu"
    if accelerator == "cuda":
        machine = machine or probe()
        device = resolve_device("cuda", machine, local_rank() if rank_on_node is None else rank_on_node)
    on_cuda = device != "cpu"
    return device, in_group_backend("cuda" if on_cuda else "cpu"), backend_for(cfg, on_cuda=on_cuda, machine=machine)


def collective_device(backend: str) -> Any:
    """Device of ftbridge's own small tensors on a ``backend`` group: this rank's GPU for NCCL, else the CPU."""
    import torch

    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def group_backend(group: Any = None) -> str:
    """``torch.distributed.get_backend(group)`` (``"gloo"`` when no world is initialised)."""
    import torch.distributed as dist

    return str(dist.get_backend(group)) if dist.is_initialized() else "gloo"


def exchange_in_group(row: List[float], group_size: Optional[int] = None, group: Any = None) -> List[List[float]]:
    """Every rank's ``row``, by group rank: one SUM all-reduce over the replica group.

    Args:
        row: this rank's row (float64-exact values: integers below 2**53, flags).
        group_size: ranks in the group (default: the group's world size); 1 needs no collective.
        group: the process group (default: the default world, which ftbridge makes the replica group).

    Returns:
        ``group_size`` rows of ``len(row)`` floats; without an initialised world, ``[row]``.

    Raises:
        RuntimeError: the all-reduce failed or timed out.
    """
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return [list(row)]
    size = dist.get_world_size(group) if group_size is None else group_size
    if size == 1:
        return [list(row)]
    rows = torch.zeros(size, len(row), dtype=torch.float64, device=collective_device(group_backend(group)))
    rows[dist.get_rank(group)] = torch.tensor(row, dtype=torch.float64)
    dist.all_reduce(rows, op=dist.ReduceOp.SUM, group=group)
    return rows.cpu().tolist()
