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

Lighthouse restarts
-------------------
The lighthouse keeps its state in memory; restarted, it numbers quorums from
1 again. torchft 0.2.0's ``Manager`` rebuilds the cross-replica process group
only when ``quorum_id != self._quorum_id`` and names the rendezvous keys
``{store}/torchft/{quorum_id}/{group_rank}``. After a restart both go wrong:

* a member whose last quorum had the id the new one repeats keeps its process
  group, while a member that saw an intermediate quorum of the new
  lighthouse rebuilds: the step fails and waits out ``cross_replica_timeout``
  (likewise a repeated id with other members than last time);
* a rebuilt group may rendezvous on the keys a quorum of the old lighthouse
  left in the same TCPStore (same prefix) and dial dead addresses.

The first case is the common one: the group whose retry reaches the new
lighthouse first gets quorum 1 alone, the other joins at quorum 2, an id
both had before. Measured here, that step failed after the 10 s
cross-replica timeout and the job paused for 20 s instead of 10.

:class:`_QuorumGuard` fixes both without touching torchft's code: it wraps the
manager's client (``Manager._client``, checked against the installed torchft
version) and, per quorum,

1. detects a restart with :func:`detect_lighthouse_restart`: the id went
   backwards, or repeated with other members (in one lighthouse's lifetime
   ids never go down and a membership change always bumps the id);
2. votes: every member of the quorum writes whether it rebuilds (torchft's
   rule, or a detected restart) to the quorum's TCPStore (``store_address``,
   the same for all members of one cross-replica group) and reads the
   others'; if any member rebuilds, all do (:func:`decide_reconfigure`), by
   setting ``Manager._quorum_id = -1`` before torchft compares. One
   ``set`` and one ``multi_get`` on that store per quorum, in torchft's
   quorum thread, overlapped with the forward pass (0.3 ms on loopback here).
   The vote also carries the member's group size: a member whose replica
   group has another number of ranks than replica rank 0's raises
   :class:`GroupSizeMismatch` there (:func:`group_size_conflict`), before
   torchft reconfigures or fetches a heal, and the training thread gets it at
   its next cross-replica call; the other members go on;
3. namespaces the rendezvous keys by the quorum's members and step
   (``{store}/ftbridge/{digest}/torchft/...``), the same for all members, so
   a repeated id does not meet the keys of a quorum of the old lighthouse.

If the vote cannot complete within a quarter of ``cross_replica_timeout``
(a member or the store's host died after the quorum), the rank falls back to
torchft's own rule: that step fails on the dead member anyway, and the next
quorum, without it, has a new id, which every member rebuilds for. (Rebuilding
on a failed vote instead was tried: the rebuild dialled the dead store for
10 s, the other ranks' ``should_commit`` timed out, and the survivor died.)

Riding out an outage needs torchft's own retries: its manager retries a
failed lighthouse call ``quorum_retries`` times, sleeping
``quorum_timeout / (quorum_retries + 1)`` between tries and reconnecting with
backoff for up to ``connect_timeout``, all inside one quorum call that the
training thread bounds by ``quorum_timeout``. See
:class:`ftbridge.config.FTBridgeConfig` and ``docs/lighthouse.md`` for the
defaults and what they survive.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch.distributed import ReduceOp
from torchft import Manager
from torchft.process_group import create_store_client
from torchft.work import _DummyWork

from ftbridge.config import FTBridgeConfig
from ftbridge.store_probe import ProbedProcessGroupGloo, ProbedProcessGroupNCCL, call_bounded
from ftbridge.transport import SafeHTTPTransport

logger = logging.getLogger(__name__)


TORCHFT_GUARDED_VERSIONS = ("0.2.",)
"""torchft versions whose ``Manager`` internals :class:`_QuorumGuard` was written against."""


@dataclass(frozen=True)
class QuorumSeen:
    """What one rank remembers of the last quorum it took part in."""

    quorum_id: int
    members: Tuple[str, ...]


def detect_lighthouse_restart(prev: Optional[QuorumSeen], quorum_id: int, members: Sequence[str]) -> bool:
    """Whether ``quorum_id``/``members`` must come from a restarted lighthouse (pure).

    Within one lighthouse's lifetime quorum ids never go down, and a quorum
    with other members always gets a new id; a quorum that breaks either
    rule comes from a restarted lighthouse (its ids start again at 1).

    Args:
        prev: the previous quorum this rank took part in (``None``: none yet).
        quorum_id: id of the new quorum.
        members: replica ids of its participants (any order).
    """
    if prev is None:
        return False
    return quorum_id < prev.quorum_id or (quorum_id == prev.quorum_id and tuple(sorted(members)) != prev.members)


def decide_reconfigure(own: bool, votes: Optional[Sequence[bool]]) -> bool:
    """The quorum-wide decision from every member's vote (pure).

    Args:
        own: this rank's own vote (torchft's rule or a detected restart).
        votes: every member's vote (``True``: rebuild), or ``None`` when the
            vote could not complete (a member or the store died).

    Returns:
        ``True`` if any member rebuilds: a process group must be rebuilt by
        all its members or by none. ``own`` when the vote failed.
    """
    if votes is None:
        return own
    return own or any(votes)


class GroupSizeMismatch(ValueError):
    """This replica group has another number of ranks than the quorum's primary: it must not heal or all-reduce."""


def group_size_conflict(sizes: Sequence[int], replica_rank: int, quorum_id: int) -> Optional[str]:
    """Why this member must leave the quorum, or ``None``: its group size differs from replica rank 0's.

    Args:
        sizes: every member's group size (ranks per replica group), by replica rank; 0 where unknown.
        replica_rank: this member's rank in the quorum.
        quorum_id: for the message.

    Replica rank 0 (the quorum's primary) is the reference, so exactly the members that differ from it
    leave and the others go on; a member of unknown size (0) is never judged.
    """
    if not sizes or replica_rank >= len(sizes):
        return None
    mine, primary = int(sizes[replica_rank]), int(sizes[0])
    if not mine or not primary or mine == primary:
        return None
    return (f"quorum {quorum_id}: this replica group has {mine} ranks but the quorum's primary group has "
            f"{primary}; every replica group must have the same number of ranks (ZeRO partitions and heal state "
            f"are shaped by it). Restart this group with {primary} ranks in all (ftbridge-run --nproc-per-node "
            f"x --nnodes), or restart every group with {mine}")


def rendezvous_namespace(members: Sequence[str], max_step: int) -> str:
    """The key namespace shared by all members of one quorum: 12 hex digits of its members and step."""
    text = "|".join(sorted(members)) + f"|{max_step}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


class _QuorumView:
    """A torchft ``QuorumResult`` with ``store_address`` replaced; every other attribute is the original's."""

    def __init__(self, result: Any, store_address: str) -> None:
        self._result = result
        self.store_address = store_address

    def __getattr__(self, name: str) -> Any:
        return getattr(self._result, name)


class _QuorumGuard:
    """Wraps torchft's ``ManagerClient`` of one rank to survive lighthouse restarts.

    Installed as ``Manager._client``; torchft calls ``_quorum`` from its
    quorum thread, then compares ``quorum_id`` with ``Manager._quorum_id`` and
    reconfigures with ``store_address``. Everything else is delegated. See
    the module docstring for what it does.
    """

    def __init__(self, manager: Manager, timeout: timedelta, on_restart: Callable[[int, int], None],
                 on_quorum: Optional[Callable[[Any], None]] = None, group_size: int = 0) -> None:
        # timeout bounds the vote: keep it well below the cross-replica timeout, which bounds the
        # other ranks' should_commit while this quorum thread votes.
        self._manager = manager
        self._on_quorum = on_quorum
        self._client = manager._client
        self._timeout = timeout
        self._on_restart = on_restart
        self._stores: Dict[str, Any] = {}
        self._last_vote: Optional[Tuple[Any, str, int]] = None
        self._group_size = group_size
        self.sizes: List[int] = []
        """Every member's group size at the last vote, by replica rank (empty when the vote failed)."""
        self.seen: Optional[QuorumSeen] = None
        self.restarts = 0
        self.forced = 0

    def _quorum(self, **kwargs: Any) -> Any:
        result = self._client._quorum(**kwargs)
        if self._on_quorum is not None:  # before torchft, on this same thread, fetches any heal of this quorum
            self._on_quorum(result)
        quorum_id, members = int(result.quorum_id), list(result.replica_ids)
        restarted = detect_lighthouse_restart(self.seen, quorum_id, members)
        if restarted:
            self.restarts += 1
            self._on_restart(self.seen.quorum_id if self.seen else -1, quorum_id)
        self.seen = QuorumSeen(quorum_id, tuple(sorted(members)))
        namespace = rendezvous_namespace(members, int(result.max_step))
        own = restarted or quorum_id != self._manager._quorum_id
        rebuild = self._vote(result, namespace, own)
        conflict = group_size_conflict(self.sizes, int(result.replica_rank), quorum_id)
        if conflict:  # before torchft reconfigures or fetches a heal with this quorum
            logger.error("%s", conflict)
            raise GroupSizeMismatch(conflict)
        if rebuild:
            if not own:
                self.forced += 1
                logger.warning("quorum %d: another member rebuilds the cross-replica process group "
                               "(its lighthouse history differs); rebuilding too", quorum_id)
            self._manager._quorum_id = -1  # torchft compares right after this returns: reconfigure
        return _QuorumView(result, f"{result.store_address}/ftbridge/{namespace}")

    def _vote(self, result: Any, namespace: str, mine: bool) -> bool:
        """Publish ``mine`` and return the quorum-wide decision (:func:`decide_reconfigure`).

        The store is the primary's: its group's rank 0. A SIGSTOPped (hung)
        rank 0 accepts TCP connections but never answers, and c10d's TCPStore
        client then blocks without a timeout (connecting, ``delete_key``), so
        the store calls run in a helper thread bounded by twice the vote
        timeout (:func:`ftbridge.store_probe.call_bounded`); past it the vote
        counts as failed.
        """
        base = f"{int(result.quorum_id)}/{namespace}"
        store, last = self._stores.get(result.store_address), self._last_vote
        votes: Optional[List[bool]] = None
        self.sizes = []
        try:
            store, votes, self.sizes = call_bounded(
                lambda: _vote_on_store(result, base, mine, store, last, self._timeout, self._group_size),
                2 * self._timeout, f"the primary's store {result.store_address}")
            self._stores = {result.store_address: store}  # one cached client: the current primary's
            self._last_vote = (store, base, int(result.replica_rank))
        except Exception as exc:  # noqa: BLE001 - a member or the store died or hung: the step fails anyway
            logger.warning("quorum %d: reconfigure vote failed (%s: %s); %s as torchft would",
                           int(result.quorum_id), type(exc).__name__, str(exc).splitlines()[0],
                           "rebuilding" if mine else "keeping the process group")
            self._stores = {}
        return decide_reconfigure(mine, votes)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def _vote_on_store(result: Any, base: str, mine: bool, store: Any, last: Optional[Tuple[Any, str, int]],
                   timeout: timedelta, group_size: int = 0) -> Tuple[Any, List[bool], List[int]]:
    """One rank's vote on the primary's store: write ``mine`` and ``group_size``, wait for every member's, read them.

    Args:
        result: torchft's quorum result (``store_address``, ``replica_rank``, ``replica_world_size``).
        base: the quorum's key prefix (quorum id and rendezvous namespace).
        mine: this rank's vote (``True``: rebuild).
        store: a cached client of that store, or ``None`` to connect.
        last: ``(store, base, replica_rank)`` of this rank's previous vote.
        timeout: bound on waiting for the other members' votes.

        group_size: ranks of this replica group (0: not published).

    Returns:
        ``(store client, votes, sizes)``, one vote and one group size per replica rank.

    Raises:
        Whatever the store raises: ``DistStoreError`` when a member's vote does not come within ``timeout``.
    """
    if store is None:
        store = create_store_client(f"{result.store_address}/ftbridge/vote", timeout=timeout)
    store.set(f"{base}/{int(result.replica_rank)}", f"{int(mine)}:{int(group_size)}".encode())
    keys = [f"{base}/{r}" for r in range(int(result.replica_world_size))]
    store.wait(keys, timeout)
    values = [bytes(v).decode(errors="replace").partition(":") for v in store.multi_get(keys)]
    votes = [v == "1" for v, _, _ in values]
    sizes = [int(n) if n.isdigit() else 0 for _, _, n in values]
    # Drop this rank's previous vote, only on the store that just answered: a previous primary's
    # store may be hung (its group's rank 0 SIGSTOPped), and deleting there blocked (chaos soak).
    if last is not None and last[0] is store and last[1] != base:
        store.delete_key(f"{last[1]}/{last[2]}")
    return store, votes, sizes


def _install_quorum_guard(manager: Manager, timeout: timedelta, on_restart: Callable[[int, int], None],
                          on_quorum: Optional[Callable[[Any], None]] = None,
                          group_size: int = 0) -> Optional[_QuorumGuard]:
    """Install :class:`_QuorumGuard` on ``manager`` if this torchft is one it was written for."""
    version = importlib.metadata.version("torchft")
    needed = ("_client", "_quorum_id", "_async_quorum")
    if not version.startswith(TORCHFT_GUARDED_VERSIONS) or not all(hasattr(manager, a) for a in needed):
        logger.warning("torchft %s is not one of %s: lighthouse-restart guard NOT installed; after a "
                       "lighthouse restart a repeated quorum id may cost a failed step, and heal URLs are not "
                       "checked against the donor's host", version,
                       TORCHFT_GUARDED_VERSIONS)
        return None
    guard = _QuorumGuard(manager, timeout, on_restart, on_quorum, group_size)
    manager._client = guard
    return guard


def _export_torchft_environ(cfg: FTBridgeConfig) -> None:
    """Set torchft's environment variables to ``cfg`` (they override the Manager's arguments).

    A different value already in the environment (a user's ``TORCHFT_TIMEOUT_SEC``)
    is replaced, with a warning naming the ftbridge setting to use instead.
    """
    for name, value in cfg.torchft_environ().items():
        old = os.environ.get(name)
        if old is not None and old != value:
            logger.warning("%s=%s in the environment is replaced by %s, derived from ftbridge's settings "
                           "(set the FTBRIDGE_* variable instead; see ftbridge.config)", name, old, value)
        os.environ[name] = value


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
        max_heal_bytes: the largest heal body this rank accepts (bytes),
            e.g. :func:`ftbridge.wire.size_bound` of its own state; called in
            torchft's quorum thread before each fetch. ``None``: no bound
            (the body is then allocated as it arrives).

    Raises:
        KeyError: ``MASTER_ADDR``/``MASTER_PORT`` unset (not launched by torchrun
            and no process group initialised).
    """

    def __init__(self, cfg: FTBridgeConfig, *, state_dict: Callable[[], Dict[str, Any]],
                 load_state_dict: Callable[[Dict[str, Any]], None], use_cuda: bool = False,
                 max_heal_bytes: Optional[Callable[[], int]] = None) -> None:
        self.cfg = cfg
        _export_torchft_environ(cfg)
        # torchft's process groups, but a quorum whose primary (its store) hangs fails configure in time.
        pg = (ProbedProcessGroupNCCL(timeout=cfg.cross_replica_timeout) if use_cuda
              else ProbedProcessGroupGloo(timeout=cfg.cross_replica_timeout))
        self.transport = SafeHTTPTransport(cfg.heal_bind, cfg.cross_replica_timeout, heal_timeout=cfg.heal_deadline,
                                           token=cfg.job_token, max_recv_bytes=max_heal_bytes)
        self.heals = 0
        self._healed_this_step = False
        self._load_state_dict = load_state_dict

        self.torchft = Manager(
            pg=pg,
            load_state_dict=self._load,
            state_dict=state_dict,
            min_replica_size=cfg.min_replicas,
            use_async_quorum=True,
            # torchft's own calls (should_commit, heal fetches) wait for the group's slowest rank, which
            # may itself be waiting out a cross-replica all-reduce on a hung peer (the process group's
            # timeout): with the same timeout, should_commit expired first and crashed the survivor.
            timeout=cfg.torchft_timeout,
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
        self.lighthouse_restarts = 0
        self.quorum_guard = _install_quorum_guard(self.torchft, cfg.cross_replica_timeout / 4,
                                                  self._on_lighthouse_restart, self._on_quorum, cfg.group_size)

    def _on_lighthouse_restart(self, old_id: int, new_id: int) -> None:
        self.lighthouse_restarts += 1
        logger.warning("[replica %d rank %d] lighthouse restarted (quorum id %d after %d): rebuilding the "
                       "cross-replica process group", self.cfg.replica_group_id, self.cfg.group_rank, new_id, old_id)

    def _on_quorum(self, result: Any) -> None:
        """Tell the transport the host this quorum's donor may serve heal state from (see ``local_group_size``).

        Raises:
            ftbridge.spare.DuplicateReplicaGroup: this group heals into a quorum in which another member
                holds its id (:func:`ftbridge.spare.must_leave`); the training thread gets it at its next
                cross-replica call.
        """
        cfg = self.cfg
        spans_nodes = 0 < cfg.local_group_size < cfg.group_size
        donor = getattr(result, "recover_src_manager_address", None) or None
        self.transport.expect_donor(None if spans_nodes and cfg.group_rank > 0 else donor)
        # -- warm spares (ftbridge.spare): a paused group whose id a spare took leaves instead of training twice
        from ftbridge.spare import DuplicateReplicaGroup, must_leave

        if must_leave(list(getattr(result, "replica_ids", []) or []), cfg.replica_group_id,
                      bool(getattr(result, "heal", False))):
            msg = (f"[replica {cfg.replica_group_id} rank {cfg.group_rank}] quorum {int(result.quorum_id)}: another "
                   f"member holds replica group {cfg.replica_group_id} (a spare took its place while this group was "
                   "paused past the heartbeat timeout); leaving so that one group trains on its data shard")
            logger.error("%s", msg)
            raise DuplicateReplicaGroup(msg)

    def _load(self, state: Dict[str, Any]) -> None:
        self._load_state_dict(state)
        self.heals += 1
        self._healed_this_step = True

    # -- per step --------------------------------------------------------
    def start_quorum(self) -> None:
        """Ask for this step's quorum, asynchronously (overlaps the forward pass)."""
        self._healed_this_step = False
        self.torchft.start_quorum()

    def allreduce(self, tensor: torch.Tensor,
                  reduce_op: Union[ReduceOp, ReduceOp.RedOpType] = ReduceOp.AVG) -> Any:
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
