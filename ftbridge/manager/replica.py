"""torchft's quorum and the cross-replica process group for one rank: :class:`ReplicaManager`.

Wraps torchft's ``Manager``, heals through :class:`ftbridge.manager.transport.SafeHTTPTransport` and drives the
commit protocol. Initialise the group's own torch.distributed world first.
Why: docs/concepts.md, "The commit protocol" and "Heal".
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from torch.distributed import ReduceOp

from ftbridge.config import FTBridgeConfig
from ftbridge.device import backend_for, exchange_in_group
from ftbridge.heal import restart_without_peer
from ftbridge.manager.commit import Agreement, GroupDecision, decide_group, encode_flags, rank_flags
from ftbridge.manager.heal_agreement import HealAgreement
from ftbridge.manager.lighthouse_status import replica_group_of
from ftbridge.manager.outage import OutageRider
from ftbridge.manager.quorum_guard import _install_quorum_guard
from ftbridge.manager.quorum_watch import start_watch
from ftbridge.manager.stand_aside import StandAside, leave_quorums, longest_pause
from ftbridge.manager.step_end import StepEndRelay
from ftbridge.manager.store_probe import ProbedProcessGroupGloo, ProbedProcessGroupNCCL
from ftbridge.manager.torchft_api import TORCHFT_GUARDED_VERSIONS, DummyWork, Manager, installed_version
from ftbridge.manager.transport import SafeHTTPTransport

logger = logging.getLogger(__name__)


def _export_torchft_environ(cfg: FTBridgeConfig) -> None:
    """Set torchft's environment variables to ``cfg``, replacing (with a warning) a different value already set."""
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
        state_dict: returns this rank's live state for a heal (nested dict of tensors and JSON scalars);
            called in torchft's quorum thread.
        load_state_dict: loads a peer's state, on the training thread inside :meth:`should_commit`.
        use_cuda: the model is on a GPU (:func:`ftbridge.device.backend_for` picks the backend).
        max_heal_bytes: returns the largest heal body this rank accepts (bytes), called at each fetch
            (:meth:`ftbridge.engine.FaultTolerantEngine.heal_size_bound` in a job).

    Raises:
        KeyError: ``MASTER_ADDR``/``MASTER_PORT`` unset.
        ValueError: ``cfg.cross_replica_backend`` cannot work here (NCCL on CPU or on a shared GPU).
    """

    def __init__(self, cfg: FTBridgeConfig, *, state_dict: Callable[[], Dict[str, Any]],
                 load_state_dict: Callable[[Dict[str, Any]], None], max_heal_bytes: Callable[[], int],
                 use_cuda: bool = False) -> None:
        self.cfg = cfg
        _export_torchft_environ(cfg)
        # Where the quorum guard is installed, its rider makes the lighthouse call's tries itself, one at a
        # time (ftbridge.manager.outage): torchft's own retries would leave requests in flight it cannot
        # take back. torchft reads this variable over its constructor argument.
        server_retries = 0 if installed_version().startswith(TORCHFT_GUARDED_VERSIONS) else cfg.quorum_retries
        os.environ["TORCHFT_QUORUM_RETRIES"] = str(server_retries)
        # torchft's process groups, but a quorum whose primary (its store) hangs fails configure in time.
        self.backend = backend_for(cfg, on_cuda=use_cuda)  # "nccl" or "gloo"
        pg = (ProbedProcessGroupNCCL(timeout=cfg.cross_replica_timeout) if self.backend == "nccl"
              else ProbedProcessGroupGloo(timeout=cfg.cross_replica_timeout))
        self.transport = SafeHTTPTransport(cfg.heal_bind, cfg.cross_replica_timeout, heal_timeout=cfg.heal_deadline,
                                           token=cfg.job_token, max_recv_bytes=max_heal_bytes, device=(
                                               torch.device("cuda", torch.cuda.current_device()) if use_cuda else None))
        self._step_end = StepEndRelay(cfg.group_rank, cfg.store_call_timeout)
        self.heals = 0
        self.heal_source: Optional[int] = None
        """Replica group id of the donor of the heal of the current quorum (``None``: no heal)."""
        self._healed_this_step = False
        self._skipped_collective = False  # torchft made an all-reduce of this step a no-op (after an error)
        self._lent: Dict[int, Any] = {}  # id -> weakref of the tensors lent for this step (lend)
        self._step_start = 0.0
        self._load_state_dict = load_state_dict

        self._torchft = Manager(
            pg=pg,
            load_state_dict=self._load,
            state_dict=state_dict,
            min_replica_size=cfg.min_replicas,
            use_async_quorum=True,
            timeout=cfg.torchft_timeout,  # 2x: docs/concepts.md, "Derived timeouts"
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
            quorum_retries=server_retries,
        )
        self.lighthouse_restarts = 0
        self.quorum_guard = _install_quorum_guard(self._torchft, cfg.vote_timeout, self._on_lighthouse_restart,
                                                  self._on_quorum, cfg.group_size, cfg.store_call_timeout,
                                                  cfg.restart_peer_wait)
        self._heal_agreement = HealAgreement(self._torchft) if self.quorum_guard is not None else None
        # The QUORUM and AGREE drivers (ftbridge.manager.outage): need the guard's hook into torchft's quorum call.
        self.outage = OutageRider.for_config(self._torchft, cfg) if self.quorum_guard is not None else None
        if self.quorum_guard is not None:
            self.quorum_guard.rider = self.outage
            self.quorum_guard.quorum_timeout = cfg.quorum_timeout
        self.quorum_watch = start_watch(cfg, self.quorum_guard, use_cuda, pg)  # cuts a hung peer off (None: off)
        if self.outage is not None:
            self.outage.skipped_collective = self.skipped_collective
        self._cross_pg = pg
        self._server_retries = server_retries
        base = cfg.stand_aside.total_seconds()
        self._stand_aside = (StandAside(base_s=base, max_s=longest_pause(base, cfg.restart_peer_wait.total_seconds()))
                             if self.quorum_guard is not None and base > 0 else None)
        self.stood_aside: Optional[Tuple[float, float]] = None
        """``(wall-clock start, seconds)`` of the pause taken after this step's commit vote, else ``None``."""
        self.verdict: Optional[StepVerdict] = None
        """This step's agreement and group decision (:meth:`decide`), ``None`` before it."""
        self.protocol_s = 0.0
        """Seconds spent in :meth:`decide` after the quorum, all steps."""
        self.protocol_steps = 0

    def _on_lighthouse_restart(self, old_id: int, new_id: int) -> None:
        self.lighthouse_restarts += 1
        logger.warning("[replica %d rank %d] lighthouse restarted (quorum id %d after %d): rebuilding the "
                       "cross-replica process group", self.cfg.replica_group_id, self.cfg.group_rank, new_id, old_id)

    def _on_quorum(self, result: Any) -> None:
        """Point the transport at this quorum's heal donor and serve early if this rank donates.

        Raises:
            ftbridge.spare.DuplicateReplicaGroup: another member of the quorum holds this group's id
                (:func:`ftbridge.spare.must_leave`).
        """
        cfg = self.cfg
        spans_nodes = 0 < cfg.local_group_size < cfg.group_size
        donor = getattr(result, "recover_src_manager_address", None) or None
        src, ids = getattr(result, "recover_src_replica_rank", None), list(getattr(result, "replica_ids", []) or [])
        self.heal_source = (replica_group_of(ids[src]) if bool(getattr(result, "heal", False)) and src is not None
                            and 0 <= int(src) < len(ids) else None)
        self.transport.expect_donor(None if spans_nodes and cfg.group_rank > 0 else donor)
        # -- warm spares (ftbridge.spare): a paused group whose id a spare took leaves instead of training twice
        from ftbridge.spare import DuplicateReplicaGroup, must_leave

        rank = getattr(result, "replica_rank", None)
        me = ids[int(rank)] if rank is not None and 0 <= int(rank) < len(ids) else None
        at_max, world = getattr(result, "max_world_size", None), getattr(result, "replica_world_size", None)
        healers = int(world) - int(at_max) if at_max is not None and world is not None else None
        if must_leave(ids, cfg.replica_group_id, bool(getattr(result, "heal", False)), me, healers):
            msg = (f"[replica {cfg.replica_group_id} rank {cfg.group_rank}] quorum {int(result.quorum_id)}: another "
                   f"member holds replica group {cfg.replica_group_id} (a spare took its place while this group was "
                   "paused past the heartbeat timeout, or two spares took it at once); leaving so that one group "
                   "trains on its data shard")
            logger.error("%s", msg)
            raise DuplicateReplicaGroup(msg)
        joiners = list(getattr(result, "recover_dst_replica_ranks", None) or [])
        if joiners:
            self._serve_early(joiners, int(result.max_step))

    def _serve_early(self, joiners: List[int], step: int) -> None:
        """Serve this donor's heal state as soon as the quorum names it a donor; best effort (docs/concepts.md, "Heal").
        """
        state_dict = getattr(self._torchft, "_manager_state_dict", None)  # behind the quorum guard's version check
        if state_dict is None:
            return
        try:
            self.transport.send_checkpoint(joiners, step, state_dict(), self.cfg.cross_replica_timeout)
        except Exception as e:  # noqa: BLE001 - torchft's send_checkpoint will raise it where it handles errors
            logger.warning("heal state for step %d not served early (%s: %s); torchft serves it after "
                           "reconfiguring", step, type(e).__name__, e)

    def _load(self, state: Dict[str, Any]) -> None:
        self._load_state_dict(state)
        self.heals += 1
        self._healed_this_step = True

    # -- per step --------------------------------------------------------
    def start_quorum(self) -> None:
        """Ask for this step's quorum, asynchronously (overlaps the forward pass)."""
        self._healed_this_step = False
        self._skipped_collective = False
        self._step_start = time.monotonic()  # the peer watch's freeze check (discard_if_dropped)
        self._lent.clear()
        self._torchft.start_quorum()

    def wait_quorum(self) -> None:
        """Block until this step's quorum (started by :meth:`start_quorum`) is decided and applied."""
        self._torchft.wait_quorum()

    def pending_heal_state(self) -> Optional[Dict[str, Any]]:
        """The donor's state this rank received in this step's quorum and will load in :meth:`should_commit`
        (the engine's ``heal_state`` form), after :meth:`wait_quorum`; ``None`` when it heals nothing."""
        pending = getattr(self._torchft, "_pending_state_dict", None)
        user = pending.get("user") if isinstance(pending, dict) else None
        state = user.get("default") if isinstance(user, dict) else None
        return state if isinstance(state, dict) else None

    def publish_step_end(self, body: Callable[[], bytes]) -> bool:
        """As a heal donor in this step's quorum, write ``body()`` for the joiners to read after the vote
        (:meth:`ftbridge.manager.step_end.StepEndRelay.publish`); call right before :meth:`decide`. Never raises."""
        return self._step_end.publish(self._last_result(), body)

    def fetch_step_end(self) -> Optional[bytes]:
        """After a committed step in which this rank healed: its donor's :meth:`publish_step_end` body, or ``None``
        (:meth:`ftbridge.manager.step_end.StepEndRelay.fetch`). Never raises."""
        return self._step_end.fetch(self._last_result()) if self._healed_this_step else None

    def _last_result(self) -> Any:
        return self.quorum_guard.last_result if self.quorum_guard is not None else None

    def step_members(self) -> Tuple[Tuple[str, ...], bool]:
        """This step's quorum members' torchft replica ids, and whether every one takes part (``False`` while a
        member heals); ``((), False)`` when the quorum is unknown. Waits for the quorum."""
        self.wait_quorum()
        result = self._last_result()
        if result is None:
            return (), False
        ids = tuple(str(r) for r in (getattr(result, "replica_ids", None) or ()))
        return ids, bool(ids) and int(getattr(result, "max_world_size", -1)) == len(ids)

    def allreduce(self, tensor: torch.Tensor,
                  reduce_op: Union[ReduceOp, ReduceOp.RedOpType] = ReduceOp.AVG) -> Any:
        """Average or sum floating-point ``tensor`` in place over the participating groups; returns a ``Work``.

        Never raises: an error is recorded, the work completes and :meth:`should_commit` returns ``False``.
        """
        clean = self._torchft.errored() is None
        if self.quorum_watch is None:
            work = self._torchft.allreduce(tensor, reduce_op=reduce_op)
        else:
            lent = self._lent.pop(id(tensor), None)
            work = self.quorum_watch.allreduce(self._torchft, tensor, reduce_op,
                                               private=lent is not None and lent() is tensor)
        if not clean or self._torchft.errored() is not None:
            # torchft issues nothing after an error (nor when the process group refused the call): this
            # rank's collectives no longer pair with its peers' in this step (the outage agreement reads it)
            self._skipped_collective = True
        return work

    def lend(self, tensor: torch.Tensor) -> None:
        """Let this step's next :meth:`allreduce` of ``tensor`` reduce it in place without a copy.

        Do not touch ``tensor`` until that wait returns; drop it when the wait fails. Reset by :meth:`start_quorum`.
        """
        self._lent[id(tensor)] = weakref.ref(tensor)

    def skipped_collective(self) -> bool:
        """Whether torchft made an all-reduce of this step a no-op after an error (its collectives no longer pair)."""
        return self._skipped_collective

    def state_dict(self) -> Dict[str, int]:
        """torchft's counters: ``{"step": committed steps, "batches_committed": int}``."""
        return dict(self._torchft.state_dict())

    def load_state_dict(self, state: Dict[str, int]) -> None:
        """Set torchft's counters from :meth:`state_dict` output (a checkpoint's)."""
        self._torchft.load_state_dict(state)

    def decide(self, guard: Optional[str] = None, empty: bool = False, waited_s: float = 0.0,
               plan: int = 0, borrowed: bool = False) -> "StepVerdict":
        """AGREE and DECIDE (:mod:`ftbridge.manager.commit`) on every rank, after the gradient all-reduces and right
        before :meth:`should_commit`: the group's one decision for this step (:attr:`verdict`). ``guard``: the
        fingerprint when due; ``empty``, ``waited_s``: for :func:`ftbridge.heal.restart_without_peer`; ``plan``,
        ``borrowed``: :attr:`ftbridge.manager.commit.View.plan`, :attr:`ftbridge.manager.commit.View.borrowed`.

        Raises:
            QuorumTimeout: no quorum within its deadline and no ride.
            QuorumGap: no quorum following the job's history for ``restart_peer_wait``.
            RuntimeError: the in-group exchange failed; the rank must exit.
        """
        tf = self._torchft
        tf.wait_quorum()
        t0 = time.perf_counter()
        if self.quorum_watch is not None:  # frozen during the step and left out meanwhile: discard
            self.quorum_watch.check_commit(tf, self._step_start)
        agreement = self.outage.agree(guard, empty, plan, borrowed) if self.outage is not None else None
        stop = self._restart_rule(agreement, empty, waited_s)
        healing, ready = self._heal_agreement.state() if self._heal_agreement is not None else (False, False)
        unreachable = self.cfg.group_rank == 0 and self._cross_pg.take_store_unreachable()
        if self.quorum_guard is not None and self.quorum_guard.majority.pending is not None:
            unreachable = False  # after a lighthouse restart the group counts towards the majority: it stays
        flags = rank_flags(step=int(tf.current_step()), errored=tf.errored() is not None, agreement=agreement,
                           healing=healing, heal_ready=ready, replica_group=self.cfg.replica_group_id, stop=stop,
                           gap_stop=self._gap_expired(), store_unreachable=unreachable)
        decision = decide_group(exchange_in_group(encode_flags(flags), self.cfg.group_size))
        if decision.gap_stop:
            raise QuorumGap(self._gap_message(agreement))
        if self._heal_agreement is not None:
            self._heal_agreement.settle(drop=decision.drop_heal)
        if not decision.commit and tf.errored() is None:
            tf.report_error(GroupDiscard(f"replica group {self.cfg.replica_group_id} discards step "
                                         f"{int(tf.current_step())}: {decision.reason}"))
        self.verdict = StepVerdict(agreement, decision)
        self.protocol_s += time.perf_counter() - t0
        self.protocol_steps += 1
        return self.verdict

    def _restart_rule(self, agreement: Optional[Agreement], empty: bool, waited_s: float) -> bool:
        """:func:`ftbridge.heal.restart_without_peer`; records the error of a step that waits; whether to stop."""
        all_empty = agreement.all_empty if agreement is not None else self.participants <= 1
        rule = restart_without_peer(restarted_empty=empty, all_members_empty=all_empty, waited_s=waited_s,
                                    limit_s=self.cfg.restart_peer_wait.total_seconds())
        if rule == "wait":
            self._torchft.report_error(RuntimeError(
                "restarted with nothing to start from, and no member of the quorum holds the job's state: step "
                "discarded while waiting for one to heal from"))
        return rule == "stop"

    def _gap_message(self, agreement: Optional[Agreement]) -> str:
        wait = self.cfg.restart_peer_wait.total_seconds()
        return (f"replica group {self.cfg.replica_group_id} was cut off from the job: for longer than "
                f"restart_peer_wait ({wait:g} s, FTBRIDGE_RESTART_PEER_WAIT_S) it has been given only quorums that "
                "follow quorums none of their members took part in, or, after a lighthouse restart, quorums without "
                "a majority of the groups before it. The groups that may have trained on meanwhile do not come "
                "back, and training on from this group's state could commit their steps again with other "
                f"parameters ({agreement.reason if agreement else ''}). Bring them back, or resume the job from a "
                "checkpoint")

    def _gap_expired(self) -> bool:
        """This rank has waited past ``restart_peer_wait`` for a quorum that follows the job's history."""
        return bool((self.outage is not None and self.outage.gap_expired)
                    or (self.quorum_guard is not None and self.quorum_guard.majority_expired))

    def should_commit(self) -> bool:
        """torchft's commit vote (an AND over the group's ranks), after :meth:`decide`; applies a pending heal first.

        Raises:
            RuntimeError: no vote within ``torchft_timeout``; the rank must exit (its vote is cast).
        """
        try:
            committed = self._torchft.should_commit()
        except TimeoutError as exc:
            bound = self.cfg.torchft_timeout.total_seconds()
            raise RuntimeError(
                f"the commit vote of replica group {self.cfg.replica_group_id} timed out after {bound:g} s "
                f"(2 x cross_replica_timeout): another rank of this group did not vote, so it is hung or far "
                "behind. This rank exits so that torchrun restarts the group, which then heals from a peer; "
                "if the ranks are only slow, raise FTBRIDGE_CROSS_REPLICA_TIMEOUT_S") from exc
        if self.outage is not None:
            verdict = self.verdict
            decision = verdict.decision if verdict is not None else None
            self.outage.after_commit(committed, bool(decision and decision.ride_next),
                                     bool(decision and decision.nobody_commits),
                                     bool(decision is None or decision.agreed),
                                     bool(decision is None or decision.met))
        if committed and self.quorum_guard is not None:
            self.quorum_guard.majority.committed()
        self.stood_aside = None
        if self._stand_aside is not None and self.verdict is not None:
            pause = self._stand_aside.step(quorum_id=int(self._torchft._quorum_id), committed=committed,
                                           store_unreachable=self.verdict.decision.store_unreachable)
            if pause > 0:
                self._stand_aside_for(pause)
        return committed

    def _stand_aside_for(self, pause_s: float) -> None:
        """:func:`ftbridge.manager.stand_aside.leave_quorums` on this rank, logged; sets :attr:`stood_aside`."""
        cfg, began = self.cfg, time.time()
        logger.warning("[replica %d rank %d step %d] the quorum's store did not answer group rank 0 in %d quorums "
                       "in a row while the lighthouse held its group alive: this group is cut off from its peers. "
                       "It leaves the quorums for %g s (FTBRIDGE_STAND_ASIDE_S doubles each time), so that the "
                       "others train on, then comes back and heals", cfg.replica_group_id, cfg.group_rank,
                       int(self._torchft.current_step()), StandAside.AFTER, pause_s)
        leave_quorums(self._torchft, pause_s=pause_s, group_rank=cfg.group_rank,
                      barrier=lambda: exchange_in_group([1.0], cfg.group_size), lighthouse_addr=cfg.lighthouse,
                      hostname=cfg.heal_bind, heartbeat_interval=cfg.heartbeat_interval,
                      connect_timeout=cfg.connect_timeout, quorum_retries=self._server_retries)
        self.stood_aside = (began, pause_s)

    def errored(self) -> Optional[Exception]:
        """The error recorded during this step, if any."""
        return self._torchft.errored()

    def report_error(self, error: Exception) -> None:
        """Record ``error``: this step will be discarded on every replica."""
        self._torchft.report_error(error)

    # -- views -----------------------------------------------------------
    @property
    def participants(self) -> int:
        """Replica groups taking part in the current step (waits for the quorum)."""
        return self._torchft.num_participants()

    @property
    def replica_rank(self) -> Optional[int]:
        """Rank of this group in the current quorum; ``None`` while healing."""
        return self._torchft.participating_rank()

    @property
    def current_step(self) -> int:
        """Committed steps so far (torchft's step)."""
        return self._torchft.current_step()

    @property
    def quorum_id(self) -> int:
        """Id of the current step's quorum (-1 before the first, or where torchft has no such field)."""
        return int(getattr(self._torchft, "_quorum_id", -1))

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
        return self._torchft.is_participating()

    def shutdown(self) -> None:
        """Stop the manager server and the heal transport (no leave message exists)."""
        self._torchft.shutdown(wait=False)
        self.transport.shutdown(wait=False)
        if self.quorum_watch is not None:
            self.quorum_watch.close()


class QuorumGap(RuntimeError):
    """This group's quorums have not followed the job's history for longer than the wait: it stops."""


class GroupDiscard(RuntimeError):
    """The replica group decided to discard this step (:func:`ftbridge.manager.commit.decide_group`)."""


@dataclass(frozen=True)
class StepVerdict:
    """:meth:`ReplicaManager.decide`'s result: this rank's agreement (``None`` without torchft's internals) and the
    group's decision."""

    agreement: Optional[Agreement]
    decision: GroupDecision


def is_dummy_work(work: Any) -> bool:
    """True for torchft's placeholder work returned after an error."""
    return isinstance(work, DummyWork)
