"""Topology and settings of one ftbridge process, resolved once (:class:`FTBridgeConfig`).

Every setting resolves as **explicit argument, then environment variable, then
default**; each field names its variables, and where an ``FTBRIDGE_*`` and a
torchft or torchrun name both exist the ``FTBRIDGE_*`` one wins.
:meth:`FTBridgeConfig.validate` checks the timeout hierarchy
(``heartbeat_interval < cross_replica_timeout < in_group_timeout``,
``cross_replica_timeout <= quorum_timeout``). Why: docs/concepts.md, "The
timeout hierarchy" and "Derived timeouts".

Example::

    cfg = FTBridgeConfig.resolve(replica_group_id=0, lighthouse="http://localhost:29510")
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Mapping, Optional, cast

from ftbridge import config_rules
from ftbridge.config_rules import (
    as_timedelta,
    check_override,
    first_set,
    parse_env,
    parse_json_object,
    whole_seconds,
)


@dataclass(frozen=True, kw_only=True)
class FTBridgeConfig:
    """Settings of one rank of one replica group.

    Build it with :meth:`resolve`; the constructor does not read the environment.
    """

    replica_group_id: int = 0
    """Id of this replica group, 0-based, stable across restarts
    (``FTBRIDGE_REPLICA_GROUP_ID`` / ``REPLICA_GROUP_ID``)."""

    num_replica_groups: int = 1
    """Replica groups the job is planned for (data sharding, logs; the live count comes from the
    quorum) (``FTBRIDGE_NUM_REPLICA_GROUPS`` / ``NUM_REPLICA_GROUPS``)."""

    spare_index: int = -1
    """-1: an active replica group. ``K >= 0``: warm spare ``K``, which stands by outside the quorum and
    takes over a dead group's id (:mod:`ftbridge.spare`; ``FTBRIDGE_SPARE_INDEX``)."""

    group_rank: int = 0
    """Rank of this process inside its replica group (``RANK`` from torchrun)."""

    group_size: int = 1
    """Ranks per replica group; ZeRO shards across exactly these (``WORLD_SIZE`` from torchrun)."""

    lighthouse: str = "http://127.0.0.1:29510"
    """Address of the torchft lighthouse (``FTBRIDGE_LIGHTHOUSE`` / ``TORCHFT_LIGHTHOUSE``)."""

    min_replicas: int = 1
    """Fewest replica groups that may commit a step (``FTBRIDGE_MIN_REPLICAS``)."""

    slots: int = 0
    """Fixed data-parallel slots of failure-transparent training (:mod:`ftbridge.slots`), at least
    :attr:`num_replica_groups`; iterate :meth:`ftbridge.engine.FaultTolerantEngine.units`. 0: off, a failure
    shrinks the global batch (``FTBRIDGE_SLOTS``)."""

    cross_replica_timeout: timedelta = timedelta(seconds=10)
    """Bound on every collective between replica groups; torchft's own calls get
    :attr:`torchft_timeout` (``FTBRIDGE_CROSS_REPLICA_TIMEOUT_S``; ``TORCHFT_TIMEOUT_SEC`` is not read)."""

    in_group_timeout: timedelta = timedelta(seconds=60)
    """Timeout of the group's own torch.distributed world (DeepSpeed's collectives)
    (``FTBRIDGE_IN_GROUP_TIMEOUT_S``)."""

    quorum_timeout: timedelta = timedelta(seconds=30)
    """Bound on one step's quorum call, retries included, so on the lighthouse outage a step that
    cannot ride waits out (docs/lighthouse.md, "Restart survival") (``FTBRIDGE_QUORUM_TIMEOUT_S`` /
    ``TORCHFT_QUORUM_TIMEOUT_SEC``)."""

    connect_timeout: timedelta = timedelta(seconds=10)
    """Timeout to open gRPC connections to the lighthouse and managers
    (``FTBRIDGE_CONNECT_TIMEOUT_S`` / ``TORCHFT_CONNECT_TIMEOUT_SEC``)."""

    heartbeat_interval: timedelta = timedelta(milliseconds=100)
    """Interval of the manager's heartbeats to the lighthouse (``FTBRIDGE_HEARTBEAT_INTERVAL_MS``)."""

    restart_peer_wait: timedelta = timedelta(seconds=30)
    """How long a group restarted with nothing to start from refuses to commit alone while it waits
    for a peer to heal from; then it exits with ``NoPeerToHealFrom`` (``FTBRIDGE_RESTART_PEER_WAIT_S``; 0: never
    wait; ignored with one group). Why: docs/design.md, "Why a commit never splits the job"."""

    stand_aside: timedelta = timedelta(seconds=30)
    """First pause of a group cut off from its peers but not from the lighthouse; doubles while it
    commits nothing, up to 8x and at most half of :attr:`restart_peer_wait` (``FTBRIDGE_STAND_ASIDE_S``; 0: never).
    See docs/concepts.md, "The commit protocol" (ASIDE)."""

    peer_watch: bool = True
    """Cut a hung peer off once the lighthouse declares it dead instead of waiting out
    :attr:`cross_replica_timeout` (CPU process groups only; costs a copy of each all-reduced message;
    :mod:`ftbridge.manager.quorum_watch`; ``FTBRIDGE_PEER_WATCH``)."""

    peer_watch_poll: timedelta = timedelta(milliseconds=100)
    """Cross-replica wait before the peer watch first reads the lighthouse's status, and its
    polling interval (``FTBRIDGE_PEER_WATCH_POLL_MS``)."""

    peer_watch_freeze_discard: timedelta = timedelta(seconds=1)
    """A rank frozen this long during a step discards it, whatever the lighthouse says; keep it
    below the lighthouse's heartbeat timeout minus the heartbeat interval (``FTBRIDGE_PEER_WATCH_FREEZE_DISCARD_MS``).
    Why: docs/concepts.md, "The timeout hierarchy"."""

    quorum_retries: int = 5
    """Retries of one quorum call: ``quorum_retries + 1`` tries of ``quorum_timeout / (quorum_retries + 1)``,
    made by ftbridge one at a time (``FTBRIDGE_QUORUM_RETRIES`` / ``TORCHFT_QUORUM_RETRIES``). Why: docs/concepts.md,
    "The commit protocol" and "The timeout hierarchy"."""

    ride_out_lighthouse_outage: bool = True
    """While the lighthouse does not answer and no group has failed, keep committing on the last
    quorum (:mod:`ftbridge.manager.outage`; ``FTBRIDGE_RIDE_OUT_LIGHTHOUSE_OUTAGE``). See docs/concepts.md,
    "The commit protocol"."""

    lighthouse_probe_timeout: timedelta = timedelta(milliseconds=100)
    """A lighthouse with no answer to ``GET /status`` within this long counts as not answering, and
    a quorum call in flight is left for a ride (``FTBRIDGE_LIGHTHOUSE_PROBE_TIMEOUT_MS``). See docs/concepts.md,
    "The commit protocol"."""

    manager_port: int = 0
    """Port of the torchft manager server on group rank 0; 0 picks a free one
    (``FTBRIDGE_MANAGER_PORT`` / ``TORCHFT_MANAGER_PORT``)."""

    heal_bind: str = "127.0.0.1"
    """Address of this node that other groups can dial: the heal transport binds to it and rank 0
    advertises its manager under it. 127.0.0.1 works on one machine only (``FTBRIDGE_HEAL_BIND``)."""

    metrics_port: Optional[int] = None
    """Port of rank 0's Prometheus ``/metrics`` on :attr:`heal_bind`; 0 picks a free port, ``None``
    serves none (``FTBRIDGE_METRICS_PORT``; :mod:`ftbridge.metrics`)."""

    heal_timeout: Optional[timedelta] = None
    """Overall deadline of one heal fetch (connect, request, whole body), also a donor's bound on one
    response; ``None``: :attr:`torchft_timeout` (``FTBRIDGE_HEAL_TIMEOUT_S``)."""

    job_token: Optional[str] = field(default=None, repr=False)
    """Shared secret of the job's ranks, at least 16 characters; with it a donor serves heal state only
    to requests carrying its HMAC. Never printed (``FTBRIDGE_JOB_TOKEN``; docs/lighthouse.md, "Security")."""

    local_group_size: int = 0
    """Ranks of this group on this node (``LOCAL_WORLD_SIZE``; 0: the whole group). Smaller than
    :attr:`group_size`: a joiner's ranks other than 0 accept heal URLs on any host."""

    init_sync: bool = False
    """torchft's heal of every group from one peer at step 0: refused when true
    (:func:`ftbridge.config_rules.check_topology`; ``FTBRIDGE_INIT_SYNC``)."""

    sync_mode: str = "per_bucket"
    """``per_bucket`` (all-reduce each reduced ZeRO bucket during backward) or ``post_backward`` (one
    all-reduce after backward) (``FTBRIDGE_SYNC_MODE``). See docs/concepts.md, "Where the sync sits in a ZeRO step"."""

    cross_replica_bucket_bytes: int = 25 << 20
    """Per-bucket mode: smallest cross-replica message, bytes (0: one per parameter fragment); default
    25 MiB, DDP's ``bucket_cap_mb`` (``FTBRIDGE_CROSS_REPLICA_BUCKET_BYTES``)."""

    checksum_every: int = 100
    """Log a SHA-256 checksum of the full parameters every this many steps (0: never); costs a pass
    over the parameters, a gather under ZeRO-3 (``FTBRIDGE_CHECKSUM_EVERY``)."""

    guard_every: int = 100
    """Divergence guard: compare the groups' master and optimizer state fingerprints every this many
    committed steps (0: never) (:mod:`ftbridge.guard`; ``FTBRIDGE_GUARD_EVERY``)."""

    guard_action: str = "heal"
    """On a guard mismatch: ``heal`` (outvoted groups discard and heal) or ``stop`` (every group raises
    ``ReplicaDivergenceError``) (``FTBRIDGE_GUARD_ACTION``)."""

    guard_on_tie: str = "stop"
    """On a guard mismatch with no majority state: ``stop`` (every group raises
    ``ReplicaDivergenceError``) or ``flag`` (log and train on) (``FTBRIDGE_GUARD_ON_TIE``)."""

    event_log: Optional[str] = None
    """Path of the JSON-lines event log; ``{replica_group}`` and ``{group_rank}`` are substituted
    (``FTBRIDGE_EVENT_LOG``)."""

    cross_replica_backend: str = "auto"
    """Backend of the cross-replica process group: ``auto``, ``nccl`` or ``gloo``; the same on every
    rank (:mod:`ftbridge.device`; ``FTBRIDGE_CROSS_REPLICA_BACKEND``)."""

    comm_hook: str = "no"
    """Hook of the cross-replica all-reduce: ``no``, ``fp16``, ``bf16``, ``power_sgd``,
    ``batched_power_sgd`` (:mod:`ftbridge.comm_hooks`; ``FTBRIDGE_COMM_HOOK``)."""

    comm_wrapper: str = "no"
    """``fp16`` or ``bf16`` cast around a PowerSGD hook, ``no`` for none (``FTBRIDGE_COMM_WRAPPER``)."""

    comm_state_option: Mapping[str, Any] = field(default_factory=dict)
    """PowerSGD options under PyTorch's names; unset ones take PyTorch's defaults
    (``FTBRIDGE_COMM_STATE_OPTION``, a JSON object)."""

    # (field name, type, env names) in precedence order.
    _ENV = {
        "replica_group_id": (int, ("FTBRIDGE_REPLICA_GROUP_ID", "REPLICA_GROUP_ID")),
        "num_replica_groups": (int, ("FTBRIDGE_NUM_REPLICA_GROUPS", "NUM_REPLICA_GROUPS")),
        "spare_index": (int, ("FTBRIDGE_SPARE_INDEX",)),
        "group_rank": (int, ("RANK",)),
        "group_size": (int, ("WORLD_SIZE",)),
        "lighthouse": (str, ("FTBRIDGE_LIGHTHOUSE", "TORCHFT_LIGHTHOUSE")),
        "min_replicas": (int, ("FTBRIDGE_MIN_REPLICAS",)),
        "slots": (int, ("FTBRIDGE_SLOTS",)),
        "cross_replica_timeout": ("s", ("FTBRIDGE_CROSS_REPLICA_TIMEOUT_S",)),
        "in_group_timeout": ("s", ("FTBRIDGE_IN_GROUP_TIMEOUT_S",)),
        "quorum_timeout": ("s", ("FTBRIDGE_QUORUM_TIMEOUT_S", "TORCHFT_QUORUM_TIMEOUT_SEC")),
        "connect_timeout": ("s", ("FTBRIDGE_CONNECT_TIMEOUT_S", "TORCHFT_CONNECT_TIMEOUT_SEC")),
        "heartbeat_interval": ("ms", ("FTBRIDGE_HEARTBEAT_INTERVAL_MS",)),
        "quorum_retries": (int, ("FTBRIDGE_QUORUM_RETRIES", "TORCHFT_QUORUM_RETRIES")),
        "peer_watch": (bool, ("FTBRIDGE_PEER_WATCH",)),
        "peer_watch_poll": ("ms", ("FTBRIDGE_PEER_WATCH_POLL_MS",)),
        "peer_watch_freeze_discard": ("ms", ("FTBRIDGE_PEER_WATCH_FREEZE_DISCARD_MS",)),
        "restart_peer_wait": ("s", ("FTBRIDGE_RESTART_PEER_WAIT_S",)),
        "stand_aside": ("s", ("FTBRIDGE_STAND_ASIDE_S",)),
        "ride_out_lighthouse_outage": (bool, ("FTBRIDGE_RIDE_OUT_LIGHTHOUSE_OUTAGE",)),
        "lighthouse_probe_timeout": ("ms", ("FTBRIDGE_LIGHTHOUSE_PROBE_TIMEOUT_MS",)),
        "manager_port": (int, ("FTBRIDGE_MANAGER_PORT", "TORCHFT_MANAGER_PORT")),
        "heal_bind": (str, ("FTBRIDGE_HEAL_BIND",)),
        "metrics_port": (int, ("FTBRIDGE_METRICS_PORT",)),
        "heal_timeout": ("s", ("FTBRIDGE_HEAL_TIMEOUT_S",)),
        "job_token": (str, ("FTBRIDGE_JOB_TOKEN",)),
        "local_group_size": (int, ("LOCAL_WORLD_SIZE",)),
        "init_sync": (bool, ("FTBRIDGE_INIT_SYNC",)),
        "sync_mode": (str, ("FTBRIDGE_SYNC_MODE",)),
        "cross_replica_bucket_bytes": (int, ("FTBRIDGE_CROSS_REPLICA_BUCKET_BYTES",)),
        "checksum_every": (int, ("FTBRIDGE_CHECKSUM_EVERY",)),
        "guard_every": (int, ("FTBRIDGE_GUARD_EVERY",)),
        "guard_action": (str, ("FTBRIDGE_GUARD_ACTION",)),
        "guard_on_tie": (str, ("FTBRIDGE_GUARD_ON_TIE",)),
        "event_log": (str, ("FTBRIDGE_EVENT_LOG",)),
        "cross_replica_backend": (str, ("FTBRIDGE_CROSS_REPLICA_BACKEND",)),
        "comm_hook": (str, ("FTBRIDGE_COMM_HOOK",)),
        "comm_wrapper": (str, ("FTBRIDGE_COMM_WRAPPER",)),
        "comm_state_option": ("json", ("FTBRIDGE_COMM_STATE_OPTION",)),
    }

    @classmethod
    def resolve(cls, environ: Optional[Mapping[str, str]] = None, **overrides: Any) -> "FTBridgeConfig":
        """Resolve every field: ``overrides`` (not ``None``), then ``environ``, then default.

        Args:
            environ: environment to read; ``os.environ`` when ``None``.
            **overrides: field values; ``None`` means "not given". Timeouts
                accept a ``timedelta`` or a number of seconds.

        Returns:
            A validated, frozen config.

        Raises:
            ValueError: an unknown field, an unparsable environment variable,
                or any rule of :meth:`validate`.
        """
        environ = os.environ if environ is None else environ
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ValueError(f"unknown ftbridge setting(s) {unknown}; valid ones are {sorted(names)}")
        values: dict[str, Any] = {}
        for name, (kind, env_names) in cls._ENV.items():
            given = overrides.get(name)
            if given is not None:
                if kind == "json" and isinstance(given, str):
                    given = parse_json_object(given, name)
                values[name] = as_timedelta(given, name) if kind in ("s", "ms") else check_override(kind, given, name)
                continue
            raw = first_set(environ, *env_names)
            if raw is None:
                continue
            env_name = next(n for n in env_names if environ.get(n) not in (None, ""))
            if kind in ("s", "ms"):
                seconds = parse_env(float, raw, env_name)
                values[name] = as_timedelta(seconds, env_name, scale=1.0 if kind == "s" else 1e-3)
            elif kind == "json":
                values[name] = parse_json_object(raw, env_name)
            else:
                values[name] = parse_env(cast(type, kind), raw, env_name)
        cfg = cls(**values)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Check every value and the timeout hierarchy (the rules are in :mod:`ftbridge.config_rules`).

        Raises:
            ValueError: naming the bad value and how to fix it.
        """
        config_rules.validate(self)

    def event_log_path(self) -> Optional[str]:
        """The event log path for this rank with placeholders substituted, or ``None``."""
        if not self.event_log:
            return None
        return self.event_log.format(replica_group=self.replica_group_id, group_rank=self.group_rank)

    @property
    def torchft_timeout(self) -> timedelta:
        """Timeout of torchft's own calls (``should_commit``, heal fetches): 2 x ``cross_replica_timeout``.

        Why: docs/concepts.md, "Derived timeouts".
        """
        return 2 * self.cross_replica_timeout

    @property
    def vote_timeout(self) -> timedelta:
        """Bound of the per-quorum reconfigure vote on the primary's store: ``cross_replica_timeout / 4``."""
        return self.cross_replica_timeout / 4

    @property
    def store_call_timeout(self) -> timedelta:
        """Bound of one call to a peer's TCPStore (run in a helper thread): 2 x :attr:`vote_timeout`."""
        return 2 * self.vote_timeout

    @property
    def sigterm_grace(self) -> timedelta:
        """After a SIGTERM, longest wait for the step in flight: 2 x ``cross_replica_timeout``; then the
        rank exits with status 143.
        """
        return 2 * self.cross_replica_timeout

    @property
    def heal_deadline(self) -> timedelta:
        """Overall deadline of one heal fetch: :attr:`heal_timeout`, else :attr:`torchft_timeout`."""
        return self.heal_timeout or self.torchft_timeout

    def torchft_environ(self) -> dict[str, str]:
        """torchft's ``TORCHFT_*`` environment variables for these settings (they override its
        constructor arguments). Whole seconds, rounded up, at least 1 s.
        """
        return {
            "TORCHFT_TIMEOUT_SEC": whole_seconds(self.torchft_timeout),
            "TORCHFT_QUORUM_TIMEOUT_SEC": whole_seconds(self.quorum_timeout),
            "TORCHFT_CONNECT_TIMEOUT_SEC": whole_seconds(self.connect_timeout),
            "TORCHFT_QUORUM_RETRIES": str(self.quorum_retries),
        }
