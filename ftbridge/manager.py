"""torchft quorum and the cross-replica process group for one rank.

:class:`ReplicaManager` wraps :class:`torchft.Manager` (composition, no
copy): group rank 0 of each replica group runs torchft's manager server,
which joins the quorum kept by the lighthouse; every rank gets a
reconfigurable cross-replica process group (torchft's ``ProcessGroupGloo``
on CPU, ``ProcessGroupNCCL`` on CUDA) linking the ranks with the same group
rank across the live replica groups. torchft rebuilds it on every quorum
change (``start_quorum`` -> ``pg.configure`` with the new quorum id).

Heals go through :class:`ftbridge.transport.SafeHTTPTransport` (no pickle,
bound to one interface). Before the manager is created, torchft's
``TORCHFT_*`` environment variables are set to the resolved config, because
torchft lets them override its constructor arguments.

Requires the replica group's own torch.distributed world to be initialised
first (``MASTER_ADDR``/``MASTER_PORT`` name its TCPStore, which group rank 0
hosts and the cross-replica process group's rendezvous may use).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Dict, Optional

import torch
from torch.distributed import ReduceOp
from torchft import Manager
from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL
from torchft.work import _DummyWork

from ftbridge.config import FTBridgeConfig
from ftbridge.transport import SafeHTTPTransport

logger = logging.getLogger(__name__)


class ReplicaManager:
    """One rank's view of the quorum: participants, replica rank, step, commit.

    Args:
        cfg: resolved configuration.
        state_dict: returns this rank's live state for a heal (nested dict of
            tensors and JSON scalars); called in torchft's quorum thread when a
            peer needs it.
        load_state_dict: loads a peer's state; called on the training thread
            inside :meth:`should_commit` of a healing step, on every rank of
            the group at the same point.
        use_cuda: build torchft's NCCL process group instead of Gloo.

    Raises:
        KeyError: ``MASTER_ADDR``/``MASTER_PORT`` unset (not launched by torchrun
            and no process group initialised).
    """

    def __init__(self, cfg: FTBridgeConfig, *, state_dict: Callable[[], Dict[str, Any]],
                 load_state_dict: Callable[[Dict[str, Any]], None], use_cuda: bool = False) -> None:
        self.cfg = cfg
        os.environ.update(cfg.torchft_environ())
        pg = (ProcessGroupNCCL(timeout=cfg.cross_replica_timeout) if use_cuda
              else ProcessGroupGloo(timeout=cfg.cross_replica_timeout))
        self.transport = SafeHTTPTransport(cfg.heal_bind, cfg.cross_replica_timeout)
        self.heals = 0
        self._healed_this_step = False
        self._load_state_dict = load_state_dict

        self.torchft = Manager(
            pg=pg,
            load_state_dict=self._load,
            state_dict=state_dict,
            min_replica_size=cfg.min_replicas,
            use_async_quorum=True,
            timeout=cfg.cross_replica_timeout,
            quorum_timeout=cfg.quorum_timeout,
            connect_timeout=cfg.connect_timeout,
            rank=cfg.group_rank,
            world_size=cfg.group_size,
            replica_id=f"replica_group_{cfg.replica_group_id}",
            lighthouse_addr=cfg.lighthouse,
            port=cfg.manager_port,
            hostname=cfg.heal_bind,
            heartbeat_interval=cfg.heartbeat_interval,
            checkpoint_transport=self.transport,
            init_sync=cfg.init_sync,
            quorum_retries=cfg.quorum_retries,
        )

    def _load(self, state: Dict[str, Any]) -> None:
        self._load_state_dict(state)
        self.heals += 1
        self._healed_this_step = True

    # -- per step --------------------------------------------------------
    def start_quorum(self) -> None:
        """Ask for this step's quorum, asynchronously (overlaps the forward pass)."""
        self._healed_this_step = False
        self.torchft.start_quorum()

    def allreduce(self, tensor: torch.Tensor, reduce_op: ReduceOp = ReduceOp.AVG) -> Any:
        """Average (or, with ``reduce_op=SUM``, sum) ``tensor`` in place over the participating replica groups.

        A healing replica contributes zeros and receives the average of the
        others. Errors never raise: they are recorded, the returned work
        completes, and :meth:`should_commit` then returns ``False`` everywhere.

        Args:
            tensor: floating point, any shape, on the process group's device.
            reduce_op: ``AVG`` (sum, then divide by the participants) or ``SUM``
                (communication hooks that divide before a low-precision cast).

        Returns:
            A ``Work`` whose ``wait()`` returns once ``tensor`` holds the result.
        """
        return self.torchft.allreduce(tensor, reduce_op=reduce_op)

    def should_commit(self) -> bool:
        """Whether every rank of every participating group may apply this step.

        Applies a pending heal first (on every rank of a healing group).
        """
        return self.torchft.should_commit()

    def errored(self) -> Optional[Exception]:
        """The error recorded during this step, if any."""
        return self.torchft.errored()

    def report_error(self, error: Exception) -> None:
        """Record ``error``: this step will be discarded on every replica."""
        self.torchft.report_error(error)

    # -- views -----------------------------------------------------------
    @property
    def participants(self) -> int:
        """Replica groups taking part in the current step (waits for the quorum)."""
        return self.torchft.num_participants()

    @property
    def replica_rank(self) -> Optional[int]:
        """Rank of this group in the current quorum; ``None`` while healing."""
        return self.torchft.participating_rank()

    @property
    def current_step(self) -> int:
        """Committed steps so far (torchft's step)."""
        return self.torchft.current_step()

    @property
    def quorum_id(self) -> int:
        """Id of the quorum of the current step (-1 before the first)."""
        return int(self.torchft._quorum_id)

    @property
    def healed_this_step(self) -> bool:
        """Whether this rank loaded a peer's state in the current step."""
        return self._healed_this_step

    def is_participating(self) -> bool:
        """False while this group heals (it then contributes zero gradients)."""
        return self.torchft.is_participating()

    def shutdown(self) -> None:
        """Stop the manager server and the heal transport (no leave message exists)."""
        self.torchft.shutdown(wait=False)
        self.transport.shutdown(wait=False)


def is_dummy_work(work: Any) -> bool:
    """True for torchft's placeholder work returned after an error."""
    return isinstance(work, _DummyWork)
