"""Training through a lighthouse outage: commit on the last quorum while no group has failed.

Without this, every step asks the lighthouse for a quorum, even when no
replica group has joined or left, so a 10 s lighthouse outage stops every
group for the whole outage plus the reconnect (about 14 s measured).
The lighthouse is only needed to *change* the membership; while it is
unreachable and nothing has failed, the groups of the last quorum can go on
with the same quorum id and the same cross-replica process group.

Per step (:class:`OutageRider`, one per rank, called by
:class:`ftbridge.manager.ReplicaManager`):

1. **Decide** (group rank 0, in torchft's quorum thread, before any
   lighthouse call; :func:`decide_ride`). The step *rides* (reuses the last
   quorum, no lighthouse call) only if the feature is on, this rank has a
   last quorum whose process group torchft still holds, the group committed
   the previous step, and either

   * the previous step was a normal one and a TCP connect to the lighthouse
     fails now (``probe``: entry), or
   * the previous step rode and *every* member reported the lighthouse
     unreachable in that step's agreement (exit is collective: as soon as one
     member sees the lighthouse again, all members go back to it at the same
     step, so none waits on a quorum the others do not ask for).

   The other ranks of the group read rank 0's decision from the group's
   TCPStore (they must all ask torchft's manager server, or none).
2. **Agree** (every rank, on the training thread, right before torchft's
   ``should_commit``; :func:`judge_rows`). In *every* step while the feature
   is on, riding or not, every member of the step's quorum writes ``(quorum
   id, digest of the members, step, ok, lighthouse seen)`` into its slot of a
   zero tensor and one SUM all-reduce over the cross-replica process group
   gathers them. The step may commit only if every slot is filled and all
   agree on quorum id, membership and step, and, in a riding step, every
   member is ok (no recorded error). Otherwise this rank reports an error:
   the step is discarded and the next one goes back to the lighthouse
   (torchft's normal path, which waits for it as before).

   Entry into riding is per group (step 1 follows that group's own probe),
   so in one step a group may ride while another got the same quorum from
   the lighthouse. Both then issue the same collectives (the gradient
   all-reduces, then the agreement): the agreement in every step is what
   makes entry collective. Made only in riding steps, it met the other
   group's next gradient all-reduce and gloo aborted on the size mismatch.
   A member whose all-reduce torchft made a no-op after an error leaves the
   agreement out (its collectives no longer pair with its peers'); the others
   fail the agreement and discard, and the next quorum rebuilds the process
   group. A member that recorded an error only after its collectives (the
   divergence guard's differing group) takes part and reports it is not ok.
   Only a riding step needs every member ok; on a quorum from the lighthouse
   each group commits or discards on its own, as with torchft alone (the
   guard relies on it: the primary commits while the differing group
   discards and heals). Every group must use the same setting:
   the quorum guard's vote carries it (:func:`ftbridge.quorum_rules.ride_setting_conflict`).

Why this never splits the job (the argument is in ``docs/concepts.md``,
"Training through a lighthouse outage"): a riding commit happens only after
an all-reduce in which every member of the last quorum took part and
reported the same quorum id, membership and step; the process group of that
quorum admits no other member, and the lighthouse, the only source of a new
membership, is not consulted. Any failure (a dead member, a disagreement,
a lighthouse that answers again) sends every member back to the lighthouse.

Safety rests on the agreement, not on the probe: a probe that is wrong
costs at most one failed step (``cross_replica_timeout``), never a split.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import socket
import threading
import urllib.parse
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, List, Optional, Sequence

import torch
from torch.distributed import AllreduceOptions, ReduceOp

logger = logging.getLogger(__name__)

ROW = 9
"""float64 values per member in the agreement: present, quorum id, four 16-bit chunks of the
membership digest, step, ok, lighthouse seen."""

PROBE_TIMEOUT = timedelta(milliseconds=250)
"""How long a TCP connect to the lighthouse may take before it counts as unreachable."""

POLL = timedelta(milliseconds=100)
"""While a lighthouse call is in flight, how often the rider checks whether the lighthouse went away."""


@dataclass(frozen=True)
class LastQuorum:
    """The last quorum this rank got from the lighthouse (what a riding step reuses).

    Attributes:
        result: torchft's quorum result as torchft saw it (``_QuorumView``).
        quorum_id: its id.
        digest: 16 hex digits, :func:`membership_digest` of its replica ids.
        replica_rank: this group's rank in it (= its rank in the process group).
        world_size: members of the quorum (= size of the process group).
    """

    result: Any
    quorum_id: int
    digest: str
    replica_rank: int
    world_size: int


@dataclass(frozen=True)
class Agreement:
    """What the members said in one step's agreement.

    Attributes:
        commit: every member is present, ok, and on the same quorum id, membership and step.
        all_unreachable: ``commit`` and no member saw the lighthouse at this step's start.
        reason: why not ``commit`` ("" when it holds).
    """

    commit: bool
    all_unreachable: bool
    reason: str


class OutageDisagreement(RuntimeError):
    """A riding step whose members did not agree (or could not): it is discarded everywhere."""


def membership_digest(replica_ids: Sequence[str]) -> str:
    """16 hex digits of SHA-256 over the sorted replica ids (each with torchft's per-process uuid)."""
    return hashlib.sha256("|".join(sorted(replica_ids)).encode()).hexdigest()[:16]


def encode_row(quorum_id: int, digest: str, step: int, ok: bool, lighthouse_seen: bool) -> List[float]:
    """One member's agreement row (exact in float64).

    Raises:
        ValueError: ``digest`` is not 16 hex digits, or ``quorum_id``/``step`` is negative or >= 2**53.
    """
    if len(digest) != 16 or not 0 <= quorum_id < 2**53 or not 0 <= step < 2**53:
        raise ValueError(f"agreement row needs a 16 hex digit digest and 0 <= quorum id, step < 2**53; got "
                         f"{digest!r}, {quorum_id}, {step}")
    value = int(digest, 16)
    chunks = [float((value >> (16 * i)) & 0xFFFF) for i in range(4)]
    return [1.0, float(quorum_id), *chunks, float(step), float(bool(ok)), float(bool(lighthouse_seen))]


def judge_rows(rows: Sequence[Sequence[float]], own: Sequence[float], require_ok: bool = True) -> Agreement:
    """The verdict of one step's agreement (pure).

    Args:
        rows: the summed agreement tensor as rows, one per member (replica rank), :data:`ROW` values each.
        own: this rank's own row (:func:`encode_row`).
        require_ok: every member must be ok (a riding step). Off for a step on a quorum from the
            lighthouse, where each group commits or discards on its own, as with torchft alone (the
            divergence guard relies on it: the differing group discards while the primary commits).

    Returns:
        :class:`Agreement`. Commit needs every row present (exactly 1 in the first value: a member
        that wrote twice, or never, shows), equal to ``own`` on quorum id, membership and step, and,
        with ``require_ok``, ok.
    """
    if not rows:
        return Agreement(False, False, "no members")
    key = [float(v) for v in own[1:7]]
    for rank, row in enumerate(rows):
        if len(row) != ROW or row[0] != 1.0:
            return Agreement(False, False, f"member {rank} missing from the agreement")
        if [float(v) for v in row[1:7]] != key:
            return Agreement(False, False, f"member {rank} is on quorum {row[1]:.0f} step {row[6]:.0f}, this rank "
                                           f"on quorum {key[0]:.0f} step {key[5]:.0f} (or another membership)")
        if row[7] != 1.0 and require_ok:
            return Agreement(False, False, f"member {rank} recorded an error in this step")
    return Agreement(True, not any(row[8] for row in rows), "")


def decide_ride(*, enabled: bool, has_last: bool, same_process_group: bool, last_committed: bool,
                rode_last: bool, last_all_unreachable: bool, lighthouse_reachable: Optional[bool]) -> bool:
    """Whether this step reuses the last quorum instead of asking the lighthouse (pure).

    Args:
        enabled: the feature is on (``ride_out_lighthouse_outage``).
        has_last: this rank has taken part in a quorum.
        same_process_group: torchft still holds that quorum's process group (its quorum id is the last one's).
        last_committed: the group committed the previous step.
        rode_last: the previous step rode.
        last_all_unreachable: its agreement passed with every member reporting the lighthouse unreachable.
        lighthouse_reachable: the probe at this step's start (``None``: not probed).

    Returns:
        ``True`` to ride. Entry (after a normal step) follows this rank's probe; staying on follows the
        previous agreement only, which every member saw the same way.
    """
    if not (enabled and has_last and same_process_group and last_committed):
        return False
    if rode_last:
        return last_all_unreachable
    return lighthouse_reachable is False


def probe_lighthouse(address: str, timeout: timedelta = PROBE_TIMEOUT) -> bool:
    """Whether a TCP connection to the lighthouse at ``address`` (``http://HOST:PORT``) opens within ``timeout``.

    A refused or timed-out connect, or a name that does not resolve, is unreachable. Sends nothing.
    """
    url = urllib.parse.urlsplit(address if "://" in address else f"http://{address}")
    try:
        with socket.create_connection((url.hostname or "", url.port or 80), timeout=timeout.total_seconds()):
            return True
    except (OSError, ValueError):
        return False


class _Reused:
    """The last quorum result, with nothing to heal and every member participating."""

    heal = False
    recover_src_manager_address = ""
    recover_src_replica_rank = None
    recover_dst_replica_ranks: List[int] = []

    def __init__(self, last: LastQuorum, step: int) -> None:
        self._result = last.result
        self.max_step = step
        self.max_replica_rank = last.replica_rank
        self.max_world_size = last.world_size

    def __getattr__(self, name: str) -> Any:
        return getattr(self._result, name)


class OutageRider:
    """One rank's state for riding out lighthouse outages (see the module docstring).

    Args:
        manager: torchft's ``Manager`` of this rank (``_quorum_id``, ``_pg``, ``_store``, ``errored``,
            ``report_error``, ``current_step``). The first three are torchft internals: the rider is
            built only inside :mod:`ftbridge.manager`, and only where
            :func:`ftbridge.manager._torchft.internals_supported` holds (``_store``, the replica
            group's TCPStore that torchft creates, has no public accessor).
        enabled: the feature is on; off, :meth:`reuse` always returns ``None`` (torchft's behaviour).
        lighthouse: the lighthouse's address, for the probe.
        group_rank: this rank's rank in its replica group (0 decides).
        group_size: ranks in the replica group.
        decision_timeout: how long a rank other than 0 waits for rank 0's decision.
        probe: ``probe(address) -> bool``; a seam for tests.
    """

    def __init__(self, manager: Any, *, enabled: bool, lighthouse: str, group_rank: int, group_size: int,
                 decision_timeout: timedelta, probe: Any = probe_lighthouse, replica_group_id: int = 0) -> None:
        self._manager = manager
        self._who = f"[replica {replica_group_id} rank {group_rank}]"
        self.enabled = enabled
        self._lighthouse, self._probe = lighthouse, probe
        self._group_rank, self._group_size = group_rank, group_size
        self._decision_timeout = decision_timeout
        self.last: Optional[LastQuorum] = None
        self.riding = False
        """Whether the current step reuses the last quorum."""
        self._reachable: Optional[bool] = None
        self._last_committed = False
        self._last_all_unreachable = False
        self._rode_last = False
        self._seq = 0
        self.rides = 0
        """Steps that reused a quorum."""
        self.ride_commits = 0
        """Of those, steps committed."""
        self.disagreements = 0
        """Agreements that did not pass (each discarded a step)."""
        self.skipped_collective: Callable[[], bool] = lambda: manager.errored() is not None
        """Whether this rank's collectives of this step may no longer pair with its peers' (set by
        :class:`ftbridge.manager.ReplicaManager`: an all-reduce torchft made a no-op after an error). The
        default, any recorded error, is the safe approximation."""
        self.watch: Any = None
        """The peer watch (:class:`ftbridge.manager.quorum_watch.QuorumWatch`) or ``None``: cuts the agreement's
        wait short when the lighthouse holds a member dead, as it does for the gradient all-reduces."""

    @classmethod
    def for_config(cls, manager: Any, cfg: Any) -> "OutageRider":
        """The rider of one rank from its :class:`ftbridge.config.FTBridgeConfig`."""
        return cls(manager, enabled=cfg.ride_out_lighthouse_outage, lighthouse=cfg.lighthouse,
                   group_rank=cfg.group_rank, group_size=cfg.group_size, decision_timeout=cfg.quorum_timeout,
                   replica_group_id=cfg.replica_group_id)

    # -- quorum thread --------------------------------------------------------
    def quorum(self, call: Callable[[], Any]) -> Any:
        """This step's quorum: the last one reused (:meth:`reuse`), or ``call()``, the lighthouse call
        (:meth:`ask`). :attr:`riding` tells which."""
        reused = self.reuse()
        return reused if reused is not None else self.ask(call)

    def remember(self, result: Any, replica_ids: Sequence[str]) -> None:
        """Keep ``result``, the quorum torchft is about to use, for later riding steps."""
        self.last = LastQuorum(result, int(result.quorum_id), membership_digest(replica_ids),
                               int(result.replica_rank), int(result.replica_world_size))

    def reuse(self) -> Optional[Any]:
        """This step's quorum result if it rides (no lighthouse call), else ``None`` (ask the lighthouse).

        Called once per step on every rank, in torchft's quorum thread, before its lighthouse call.
        """
        self._seq += 1
        self.riding = False
        if not self.enabled:
            return None
        ride = self._decide() if self._group_rank == 0 else False
        if self._group_size > 1:
            ride = self._share(ride)
        last = self.last
        if ride and (last is None or int(self._manager._quorum_id) != last.quorum_id):
            logger.error("%s the group rides out a lighthouse outage but this rank holds no matching "
                         "quorum; asking the lighthouse", self._who)
            return None
        if not ride or last is None:
            return None
        self.riding = True
        self.rides += 1
        return _Reused(last, int(self._manager.current_step()))

    def ask(self, call: Callable[[], Any]) -> Any:
        """Run ``call`` (the lighthouse call of a step that does not ride); ride instead if the lighthouse
        goes away while it is in flight.

        A lighthouse that dies during a quorum call leaves torchft's manager retrying it until
        ``quorum_timeout``. While the call runs, group rank 0 probes the lighthouse every :data:`POLL`;
        once it is unreachable (and the step may ride, :func:`decide_ride`), the call is left to time out
        in its thread and the step rides; the other ranks of the group follow through the store.

        Returns:
            ``call()``'s result, or the reused quorum (then :attr:`riding` is set).

        Raises:
            Whatever ``call`` raises, when the step does not ride.
        """
        if not self.enabled or self.last is None or int(self._manager._quorum_id) != self.last.quorum_id:
            return call()
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(call())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                future.set_exception(exc)

        threading.Thread(target=run, name="ftbridge-quorum-call", daemon=True).start()
        key = f"ftbridge/outage/{self._seq}/abandon"
        while True:
            try:
                return future.result(timeout=POLL.total_seconds())
            except concurrent.futures.TimeoutError:
                pass
            if self._abandon(key):
                logger.warning("%s lighthouse %s went away during a quorum call: leaving the call and committing "
                               "on the last quorum (id %d)", self._who, self._lighthouse, self.last.quorum_id)
                self.riding = True
                self.rides += 1
                return _Reused(self.last, int(self._manager.current_step()))

    def _abandon(self, key: str) -> bool:
        """Whether to leave the lighthouse call in flight (rank 0 probes and publishes; the others read)."""
        try:
            if self._group_rank != 0:
                return bool(self._manager._store.check([key]))
            self._reachable = self._probe(self._lighthouse)
            go = decide_ride(enabled=True, has_last=True, same_process_group=True,
                             last_committed=self._last_committed, rode_last=False, last_all_unreachable=False,
                             lighthouse_reachable=self._reachable)
            if go and self._group_size > 1:
                self._manager._store.set(key, b"1")
            return go
        except Exception as exc:  # noqa: BLE001 - no shared decision: keep waiting for the lighthouse
            logger.warning("%s outage check failed (%s); waiting for the lighthouse", self._who, exc)
            return False

    def _decide(self) -> bool:
        last = self.last
        self._reachable = None if not self.enabled else self._probe(self._lighthouse)
        ride = decide_ride(enabled=self.enabled, has_last=last is not None,
                           same_process_group=last is not None and int(self._manager._quorum_id) == last.quorum_id,
                           last_committed=self._last_committed, rode_last=self._rode_last,
                           last_all_unreachable=self._last_all_unreachable, lighthouse_reachable=self._reachable)
        if ride and not self._rode_last:
            logger.warning("%s lighthouse %s unreachable: committing on the last quorum (id %d, %d members) "
                           "while no group fails", self._who, self._lighthouse, last.quorum_id if last else -1,
                           last.world_size if last else 0)
        elif self._rode_last and not ride:
            logger.warning("%s back to the lighthouse (%d steps without it so far) on quorum %d (%s)", self._who,
                           self.rides,
                           last.quorum_id if last else -1,
                           "a member sees it again" if self._last_committed else "a riding step failed")
        return ride

    def _share(self, ride: bool) -> bool:
        """Rank 0's decision for this step, read by every rank of the group from the group's TCPStore."""
        store, key = self._manager._store, f"ftbridge/outage/{self._seq}"
        try:
            if self._group_rank == 0:
                store.set(key, b"1" if ride else b"0")
                if self._seq > 2:  # every rank has read it: they all passed the last step's should_commit
                    store.delete_key(f"ftbridge/outage/{self._seq - 2}")
                    store.delete_key(f"ftbridge/outage/{self._seq - 2}/abandon")
                return ride
            store.wait([key], self._decision_timeout)
            return bytes(store.get(key)) == b"1"
        except Exception as exc:  # noqa: BLE001 - no shared decision: the lighthouse path, like torchft
            logger.warning("%s outage decision not shared (%s); asking the lighthouse", self._who, exc)
            return False

    # -- training thread ----------------------------------------------------------
    def before_commit(self) -> Optional[Agreement]:
        """Agree with every member of this step's quorum before torchft's ``should_commit``.

        Made in *every* step while the feature is on, riding or not, so that every member issues the
        same collectives in every step whichever way its group decided to get the quorum (a group
        that rides and one that asked the lighthouse run the same sequence: the gradient all-reduces,
        then this one). Skipped (``None``) when the feature is off, before the first quorum, when
        this step's process group is not the last quorum's or has failed, or when torchft made one of
        this step's all-reduces a no-op after an error (:attr:`skipped_collective`): adding this one
        could then pair it with a peer's gradient all-reduce of another size (gloo aborts the process
        on that). The peers then fail this agreement (within the cross-replica timeout, or at once when
        the peer watch sees the member dead) and discard; the next quorum rebuilds the process group.
        A rank that recorded an error after its collectives (the divergence guard's differing group)
        takes part, reporting it is not ok.

        A riding step commits only if every member is present, consistent and ok
        (:func:`judge_rows`). A step on a quorum from the lighthouse needs every member present and
        consistent; whether each group commits stays its own decision (torchft's ``should_commit``),
        so one member's local error does not discard the others' step. On disagreement or a failed
        all-reduce, records an error with torchft (the step is discarded on this group; the others
        disagree too, or fail on this one). Never raises.
        """
        if not self.enabled or self.last is None:
            return None
        m, last = self._manager, self.last
        if int(m._quorum_id) != last.quorum_id or m._pg.errored() is not None or self.skipped_collective():
            if self.riding:
                self._last_all_unreachable = False
                return Agreement(False, False, "this rank recorded an error in this step")
            return None
        seen = bool(self._reachable) if self.riding else True
        own = encode_row(last.quorum_id, last.digest, int(m.current_step()), m.errored() is None, seen)
        try:
            rows = torch.zeros(last.world_size, ROW, dtype=torch.float64)
            rows[last.replica_rank] = torch.tensor(own, dtype=torch.float64)
            opts = AllreduceOptions()
            opts.reduceOp = ReduceOp(ReduceOp.SUM)
            work = m._pg.allreduce([rows], opts)
            lost = self.watch.wait(work) if self.watch is not None and hasattr(work, "get_future") else ()
            if lost:  # the peer watch: the lighthouse holds a member dead, no point waiting out the timeout
                self.watch.cut_short(m, f"the lighthouse holds {', '.join(lost)} dead: outage agreement abandoned")
                raise RuntimeError(f"members {', '.join(lost)} lost")
            work.wait()
            verdict = judge_rows(rows.tolist(), own, require_ok=self.riding)
        except Exception as exc:  # noqa: BLE001 - a member died or hung: discard, back to the lighthouse
            verdict = Agreement(False, False, f"agreement all-reduce failed: {type(exc).__name__}: {exc}")
        if not verdict.commit and m.errored() is None:
            self.disagreements += 1
            m.report_error(OutageDisagreement(
                f"step {int(m.current_step())} on quorum {last.quorum_id} "
                f"{'without the lighthouse' if self.riding else 'from the lighthouse'}: {verdict.reason}"))
        if self.riding:
            self._last_all_unreachable = verdict.all_unreachable
        return verdict

    def commit(self, should_commit: Callable[[], bool]) -> bool:
        """:meth:`before_commit`, then torchft's ``should_commit()``, then :meth:`after_commit`; its result."""
        self.before_commit()
        committed = should_commit()
        self.after_commit(committed)
        return committed

    def after_commit(self, committed: bool) -> None:
        """Record the group's ``should_commit`` result for the next step's decision."""
        self._last_committed = committed
        self._rode_last = self.riding
        if self.riding and committed:
            self.ride_commits += 1
        if not self.riding:
            self._last_all_unreachable = False
