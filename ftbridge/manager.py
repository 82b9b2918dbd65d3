"""torchft quorum and the cross-replica process group for one rank.

:class:`ReplicaManager` wraps :class:`torchft.Manager` (composition, no
copy): group rank 0 of each replica group runs torchft's manager server,
which joins the quorum kept by the lighthouse; every rank gets a
reconfigurable cross-replica process group (torchft's gloo or NCCL one,
:mod:`ftbridge.device`) linking the ranks with the same group rank across
the live replica groups; torchft rebuilds it on every quorum change.

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
1 again, which torchft 0.2 mistakes for old quorums. :class:`_QuorumGuard`
wraps the manager's client (``Manager._client``, checked against the
installed torchft version) and, per quorum, detects a restart, runs a vote
on the quorum's TCPStore so that every member rebuilds the cross-replica
process group or none does, refuses a member of another group size, and
namespaces the rendezvous keys. The rules, and why, are in
:mod:`ftbridge.quorum_rules`.

Riding out an outage needs torchft's own retries: its manager retries a
failed lighthouse call ``quorum_retries`` times, sleeping
``quorum_timeout / (quorum_retries + 1)`` between tries and reconnecting with
backoff for up to ``connect_timeout``, all inside one quorum call that the
training thread bounds by ``quorum_timeout``. See
:class:`ftbridge.config.FTBridgeConfig` and ``docs/lighthouse.md`` for the
defaults and what they survive.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import time
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torchft import Manager
from torchft.process_group import create_store_client
from torchft.work import _DummyWork

from ftbridge.config import FTBridgeConfig
from ftbridge.device import backend_for, collective_device, group_backend
from ftbridge.outage import OutageRider
from ftbridge.quorum_rules import (
    GroupSizeMismatch,
    QuorumSeen,
    decide_reconfigure,
    detect_lighthouse_restart,
    group_size_conflict,
    rendezvous_namespace,
)
from ftbridge.quorum_watch import start_watch, wait_for_keys
from ftbridge.store_probe import ProbedProcessGroupGloo, ProbedProcessGroupNCCL, call_bounded
from ftbridge.transport import SafeHTTPTransport

logger = logging.getLogger(__name__)


TORCHFT_GUARDED_VERSIONS = ("0.2.",)
"""torchft versions whose ``Manager`` internals :class:`_QuorumGuard` was written against."""


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
                 on_quorum: Optional[Callable[[Any], None]] = None, group_size: int = 0,
                 store_timeout: Optional[timedelta] = None) -> None:
        # timeout bounds the vote (FTBridgeConfig.vote_timeout), store_timeout each store call
        # (FTBridgeConfig.store_call_timeout; default 2 x timeout).
        self._manager = manager
        self._store_timeout = store_timeout
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
        self.rider: Optional[OutageRider] = None
        """Rides out lighthouse outages on the last quorum (:mod:`ftbridge.outage`); set by ReplicaManager."""
        self.watch: Any = None
        """The peer watch (:class:`ftbridge.quorum_watch.QuorumWatch`) or ``None``: after it cut a wait short
        this member votes to rebuild; it cuts the vote's wait short when a member is dead."""

    def _quorum(self, **kwargs: Any) -> Any:
        call = lambda: self._client._quorum(**kwargs)  # noqa: E731
        result = self.rider.quorum(call) if self.rider is not None else call()  # lighthouse outage (ftbridge.outage)
        if self.rider is not None and self.rider.riding:  # the last quorum again: nothing below applies
            return result
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
        if self.watch is not None and self.watch.take_rebuild():  # peer watch (ftbridge.quorum_watch)
            own = True
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
        view = _QuorumView(result, f"{result.store_address}/ftbridge/{namespace}")
        if self.rider is not None:  # lighthouse outage (ftbridge.outage): the quorum a riding step reuses
            self.rider.remember(view, members)
        return view

    def _vote(self, result: Any, namespace: str, mine: bool) -> bool:
        """Publish ``mine`` and return the quorum-wide decision (:func:`decide_reconfigure`).

        The store is the primary's: its group's rank 0. A SIGSTOPped (hung)
        rank 0 accepts TCP connections but never answers, and c10d's TCPStore
        client then blocks without a timeout (connecting, ``delete_key``), so
        the store calls run in a helper thread bounded by
        ``FTBridgeConfig.store_call_timeout`` (:func:`ftbridge.store_probe.call_bounded`);
        past it the vote counts as failed.
        """
        base = f"{int(result.quorum_id)}/{namespace}"
        store, last = self._stores.get(result.store_address), self._last_vote
        votes: Optional[List[bool]] = None
        self.sizes = []
        try:
            store, votes, self.sizes = call_bounded(
                lambda: _vote_on_store(result, base, mine, store, last, self._timeout, self._group_size, self.watch),
                self._store_timeout or 2 * self._timeout, f"the primary's store {result.store_address}")
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
                   timeout: timedelta, group_size: int = 0, watch: Any = None) -> Tuple[Any, List[bool], List[int]]:
    """One rank's vote on the primary's store: write ``mine`` and ``group_size``, wait for every member's, read them.

    Args:
        result: torchft's quorum result (``store_address``, ``replica_rank``, ``replica_world_size``).
        base: the quorum's key prefix (quorum id and rendezvous namespace).
        mine: this rank's vote (``True``: rebuild).
        store: a cached client of that store, or ``None`` to connect.
        last: ``(store, base, replica_rank)`` of this rank's previous vote.
        timeout: bound on waiting for the other members' votes.

        group_size: ranks of this replica group (0: not published).
        watch: the peer watch, which ends the wait early once a member is dead (``None``: none).

    Returns:
        ``(store client, votes, sizes)``, one vote and one group size per replica rank.

    Raises:
        Whatever the store raises: ``DistStoreError`` when a member's vote does not come within ``timeout``.
    """
    if store is None:
        store = create_store_client(f"{result.store_address}/ftbridge/vote", timeout=timeout)
    store.set(f"{base}/{int(result.replica_rank)}", f"{int(mine)}:{int(group_size)}".encode())
    keys = [f"{base}/{r}" for r in range(int(result.replica_world_size))]
    wait_for_keys(store, keys, timeout, watch)
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
                          group_size: int = 0, store_timeout: Optional[timedelta] = None) -> Optional[_QuorumGuard]:
    """Install :class:`_QuorumGuard` on ``manager`` if this torchft is one it was written for."""
    version = importlib.metadata.version("torchft")
    needed = ("_client", "_quorum_id", "_async_quorum")
    if not version.startswith(TORCHFT_GUARDED_VERSIONS) or not all(hasattr(manager, a) for a in needed):
        logger.warning("torchft %s is not one of %s: lighthouse-restart guard NOT installed; after a "
                       "lighthouse restart a repeated quorum id may cost a failed step, and heal URLs are not "
                       "checked against the donor's host", version,
                       TORCHFT_GUARDED_VERSIONS)
        return None
    guard = _QuorumGuard(manager, timeout, on_restart, on_quorum, group_size, store_timeout)
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


class HealAgreement:
    """The ranks of one replica group apply a heal together or not at all (torchft 0.2 internals).

    torchft heals per rank: each group rank of a joining group fetches the
    state of the same group rank in a healthy group on torchft's quorum
    thread, and ``should_commit`` applies it. ftbridge's load ends with a
    collective inside the group (ZeRO-1/2 all-gather the updated parameters;
    ZeRO-3 wraps the load in its checkpoint events), so either every rank of
    the group loads, or none may. If a donor dies half-way, some ranks may
    hold a complete state and others none: left alone, the group would hang
    in that collective until the in-group timeout. :meth:`agree` prevents it
    with one small all-reduce inside the group, only in a step that heals.

    torchft also loads its own counters (``step``, ``batches_committed``)
    from the donor as soon as a rank's fetch succeeds; a dropped heal must
    take those back too, or the ranks of the group report different steps.
    The constructor wraps the manager's ``load_state_dict`` to remember them.

    There is no public torchft API for "did this rank's fetch succeed": this
    reads ``_healing`` and ``_pending_state_dict``, so :class:`ReplicaManager`
    builds it only for the torchft versions in :data:`TORCHFT_GUARDED_VERSIONS`.

    Args:
        manager: the rank's ``torchft.Manager`` (or an object with the same
            ``state_dict``/``load_state_dict``/``wait_quorum``/``errored``/
            ``report_error`` and ``_healing``/``_pending_state_dict``).
    """

    def __init__(self, manager: Any) -> None:
        self._manager = manager
        self._before: Optional[Dict[str, Any]] = None
        self._load_counters = manager.load_state_dict

        def load_state_dict(state: Any) -> None:  # torchft's quorum thread, right after a fetch
            self._before = manager.state_dict()
            self._load_counters(state)

        manager.load_state_dict = load_state_dict

    def agree(self, group: Optional[Any] = None) -> bool:
        """Whether this step's heal state may be applied; call on every rank of the group before ``should_commit``.

        Args:
            group: the replica group's process group (default: the default
                world, which ftbridge makes the replica group).

        Returns:
            ``True`` if this step does not heal, or every rank of the group
            holds its complete heal state. ``False`` if any rank failed: this
            rank's received state is dropped, an error is reported to torchft
            (the step is discarded on every replica and the next quorum heals
            again), and torchft's counters are put back to their values
            before the heal.
        """
        m = self._manager
        if not getattr(m, "_healing", False):
            return True
        m.wait_quorum()  # the fetch runs on torchft's quorum thread
        ok = getattr(m, "_pending_state_dict", None) is not None and m.errored() is None
        flag = torch.tensor([int(ok)], dtype=torch.int32, device=collective_device(group_backend(group)))
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        before, self._before = self._before, None
        if flag.item():
            return True
        m._pending_state_dict = None
        if before is not None:  # torchft already took the donor's step: take it back
            self._load_counters(before)
        if ok:
            m.report_error(RuntimeError(
                "another rank of this replica group did not receive its heal state (its donor died or the "
                "transfer broke); no rank applies a heal this step, the next quorum heals again"))
            logger.warning("heal dropped: another rank of this replica group failed to receive its state")
        return False


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
        use_cuda: the model is on a GPU: torchft's NCCL group, or gloo with CUDA tensors where groups
            share a GPU (:func:`ftbridge.device.backend_for`); on the CPU always gloo.
        max_heal_bytes: the largest heal body this rank accepts (bytes),
            e.g. :func:`ftbridge.wire.size_bound` of its own state; called in
            torchft's quorum thread before each fetch. ``None``: no bound
            (the body is then allocated as it arrives).

    Raises:
        KeyError: ``MASTER_ADDR``/``MASTER_PORT`` unset (not launched by torchrun
            and no process group initialised).
        ValueError: ``cfg.cross_replica_backend`` cannot work here (NCCL on CPU or on a shared GPU).
    """

    def __init__(self, cfg: FTBridgeConfig, *, state_dict: Callable[[], Dict[str, Any]],
                 load_state_dict: Callable[[Dict[str, Any]], None], use_cuda: bool = False,
                 max_heal_bytes: Optional[Callable[[], int]] = None) -> None:
        self.cfg = cfg
        _export_torchft_environ(cfg)
        # torchft's process groups, but a quorum whose primary (its store) hangs fails configure in time.
        self.backend = backend_for(cfg, on_cuda=use_cuda)  # "nccl" or "gloo"
        pg = (ProbedProcessGroupNCCL(timeout=cfg.cross_replica_timeout) if self.backend == "nccl"
              else ProbedProcessGroupGloo(timeout=cfg.cross_replica_timeout))
        self.transport = SafeHTTPTransport(cfg.heal_bind, cfg.cross_replica_timeout, heal_timeout=cfg.heal_deadline,
                                           token=cfg.job_token, max_recv_bytes=max_heal_bytes, device=(
                                               torch.device("cuda", torch.cuda.current_device()) if use_cuda else None))
        self.heals = 0
        self._healed_this_step = False
        self._step_start = 0.0
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
        self.quorum_guard = _install_quorum_guard(self.torchft, cfg.vote_timeout, self._on_lighthouse_restart,
                                                  self._on_quorum, cfg.group_size, cfg.store_call_timeout)
        self._heal_agreement = HealAgreement(self.torchft) if self.quorum_guard is not None else None
        # Lighthouse outage (ftbridge.outage): needs the guard's hook into torchft's quorum call.
        self.outage = OutageRider.for_config(self.torchft, cfg) if self.quorum_guard is not None else None
        if self.quorum_guard is not None:
            self.quorum_guard.rider = self.outage
        self.quorum_watch = start_watch(cfg, self.quorum_guard, use_cuda)  # cuts a hung peer off (None: off)

    def discard_if_dropped(self) -> None:
        """Before ``should_commit``: discard this step if this process was frozen since :meth:`start_quorum`
        and the lighthouse has since left its group out (:meth:`ftbridge.quorum_watch.QuorumWatch.check_commit`)."""
        if self.quorum_watch is not None:
            self.quorum_watch.check_commit(self.torchft, self._step_start)

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
        self._step_start = time.monotonic()  # the peer watch's freeze check (discard_if_dropped)
        self.torchft.start_quorum()

    def wait_quorum(self) -> None:
        """Block until this step's quorum (started by :meth:`start_quorum`) is decided and applied."""
        self.torchft.wait_quorum()

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
        if self.quorum_watch is None:
            return self.torchft.allreduce(tensor, reduce_op=reduce_op)
        return self.quorum_watch.allreduce(self.torchft, tensor, reduce_op)

    def agree_on_heal(self) -> bool:
        """Make the ranks of this replica group agree whether this step's heal may be applied (:class:`HealAgreement`).

        Call on every rank of the group right before :meth:`should_commit`.
        With a torchft version it was not written for, no agreement is made
        and ``True`` is returned (a warning said so at start-up).
        """
        return self._heal_agreement.agree() if self._heal_agreement is not None else True

    def state_dict(self) -> Dict[str, int]:
        """torchft's counters: ``{"step": committed steps, "batches_committed": int}``."""
        return dict(self.torchft.state_dict())

    def load_state_dict(self, state: Dict[str, int]) -> None:
        """Set torchft's counters from :meth:`state_dict` output (a checkpoint's)."""
        self.torchft.load_state_dict(state)

    def should_commit(self) -> bool:
        """Whether every rank of every participating group may apply this step.

        Applies a pending heal first (on every rank of a healing group). In a step that rides out a
        lighthouse outage, every member of the last quorum must first agree on quorum, membership and
        step (:meth:`ftbridge.outage.OutageRider.before_commit`).
        """
        if self.outage is None:
            return self.torchft.should_commit()
        return self.outage.commit(self.torchft.should_commit)  # lighthouse outage (ftbridge.outage)

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
    def rode_out_outage(self) -> bool:
        """Whether the current step reuses the last quorum because the lighthouse is unreachable."""
        return self.outage is not None and self.outage.riding

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
        if self.quorum_watch is not None:
            self.quorum_watch.close()


def is_dummy_work(work: Any) -> bool:
    """True for torchft's placeholder work returned after an error."""
    return isinstance(work, _DummyWork)
