"""Settings of one ftbridge process (:class:`FTBridgeConfig`), resolved once: ``FTBridgeConfig.resolve()``.

Each setting resolves as explicit argument, then environment variable, then default; where an ``FTBRIDGE_*`` and a
torchft or torchrun variable both exist, the ``FTBRIDGE_*`` one wins. :meth:`FTBridgeConfig.validate` checks the
timeout hierarchy. Why: docs/concepts.md, "The timeout hierarchy" and "Derived timeouts".
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
    """Settings of one rank of one replica group; build it with :meth:`resolve` (the constructor reads no env)."""

    replica_group_id: int = 0
    """Id of this replica group, stable across restarts (``FTBRIDGE_REPLICA_GROUP_ID`` / ``REPLICA_GROUP_ID``)."""

    num_replica_groups: int = 1
    """Replica groups the job is planned for (``FTBRIDGE_NUM_REPLICA_GROUPS`` / ``NUM_REPLICA_GROUPS``)."""

    spare_index: int = -1
    """-1: an active replica group; ``K >= 0``: warm spare ``K`` (:mod:`ftbridge.spare`; ``FTBRIDGE_SPARE_INDEX``)."""

    group_rank: int = 0
    """Rank of this process inside its replica group (``RANK`` from torchrun)."""

    group_size: int = 1
    """Ranks per replica group; ZeRO shards across exactly these (``WORLD_SIZE`` from torchrun)."""

    lighthouse: str = "http://127.0.0.1:29510"
    """Address of the torchft lighthouse (``FTBRIDGE_LIGHTHOUSE`` / ``TORCHFT_LIGHTHOUSE``)."""

    min_replicas: int = 1
    """Fewest replica groups that may commit a step (``FTBRIDGE_MIN_REPLICAS``)."""

    slots: int = 0
    """Fixed data-parallel slots (:mod:`ftbridge.slots`), at least :attr:`num_replica_groups`; 0: off, a failure
    shrinks the global batch (``FTBRIDGE_SLOTS``)."""

    cross_replica_timeout: timedelta = timedelta(seconds=10)
    """Bound on every collective between replica groups; torchft's own calls get :attr:`torchft_timeout`
    (``FTBRIDGE_CROSS_REPLICA_TIMEOUT_S``; ``TORCHFT_TIMEOUT_SEC`` is not read)."""

    in_group_timeout: timedelta = timedelta(seconds=60)
    """Timeout of the group's own torch.distributed world (``FTBRIDGE_IN_GROUP_TIMEOUT_S``)."""

    quorum_timeout: timedelta = timedelta(seconds=30)
    """Bound on one quorum call, retries included (``FTBRIDGE_QUORUM_TIMEOUT_S`` / ``TORCHFT_QUORUM_TIMEOUT_SEC``)."""

    connect_timeout: timedelta = timedelta(seconds=10)
    """Timeout to open gRPC connections to the lighthouse and managers (``FTBRIDGE_CONNECT_TIMEOUT_S`` /
    ``TORCHFT_CONNECT_TIMEOUT_SEC``)."""

    heartbeat_interval: timedelta = timedelta(milliseconds=100)
    """Interval of the manager's heartbeats to the lighthouse (``FTBRIDGE_HEARTBEAT_INTERVAL_MS``)."""

    restart_peer_wait: timedelta = timedelta(seconds=30)
    """How long a restarted group with no state waits for a peer to heal from, then exits with ``NoPeerToHealFrom``;
    0: never wait; ignored with one group (``FTBRIDGE_RESTART_PEER_WAIT_S``)."""

    stand_aside: timedelta = timedelta(seconds=30)
    """First pause of a group cut off from its peers but not from the lighthouse; doubles up to 8x and at most
    half of :attr:`restart_peer_wait`; 0: never (``FTBRIDGE_STAND_ASIDE_S``)."""

    peer_watch: bool = True
    """Cut a hung peer off once the lighthouse declares it dead; gloo process groups only, costs a copy of each
    all-reduced message (:mod:`ftbridge.manager.quorum_watch`; ``FTBRIDGE_PEER_WATCH``)."""

    peer_watch_poll: timedelta = timedelta(milliseconds=100)
    """Peer watch's wait before its first look at the lighthouse, and its poll (``FTBRIDGE_PEER_WATCH_POLL_MS``)."""

    peer_watch_freeze_discard: timedelta = timedelta(seconds=1)
    """A rank frozen this long during a step discards it, whatever the lighthouse says
    (``FTBRIDGE_PEER_WATCH_FREEZE_DISCARD_MS``)."""

    quorum_retries: int = 5
    """Retries of one quorum call, each try ``quorum_timeout / (quorum_retries + 1)`` (``FTBRIDGE_QUORUM_RETRIES`` /
    ``TORCHFT_QUORUM_RETRIES``)."""

    ride_out_lighthouse_outage: bool = True
    """While the lighthouse does not answer and no group has failed, commit on the last quorum
    (:mod:`ftbridge.manager.outage`; ``FTBRIDGE_RIDE_OUT_LIGHTHOUSE_OUTAGE``)."""

    lighthouse_probe_timeout: timedelta = timedelta(milliseconds=100)
    """A lighthouse with no answer to ``GET /status`` within this counts as not answering
    (``FTBRIDGE_LIGHTHOUSE_PROBE_TIMEOUT_MS``)."""

    manager_port: int = 0
    """Port of rank 0's torchft manager server; 0: a free one (``FTBRIDGE_MANAGER_PORT`` / ``TORCHFT_MANAGER_PORT``)."""

    heal_bind: str = "127.0.0.1"
    """Address other groups dial for heals and rank 0's manager; 127.0.0.1 works on one machine only
    (``FTBRIDGE_HEAL_BIND``)."""

    metrics_port: Optional[int] = None
    """Port of rank 0's Prometheus ``/metrics`` on :attr:`heal_bind`; 0: a free port, ``None``: none
    (``FTBRIDGE_METRICS_PORT``)."""

    heal_timeout: Optional[timedelta] = None
    """Deadline of one heal fetch and of a donor's response; ``None``: :attr:`torchft_timeout`
    (``FTBRIDGE_HEAL_TIMEOUT_S``)."""

    job_token: Optional[str] = field(default=None, repr=False)
    """Shared secret, at least 16 characters; donors serve heal state only to requests with its HMAC. Never
    printed (``FTBRIDGE_JOB_TOKEN``)."""

    local_group_size: int = 0
    """Ranks of this group on this node; 0: the whole group. When smaller than :attr:`group_size`, ranks other
    than 0 accept heal URLs on any host (``LOCAL_WORLD_SIZE``)."""

    init_sync: bool = False
    """torchft's step-0 heal of every group from one peer; refused when true (``FTBRIDGE_INIT_SYNC``)."""

    sync_mode: str = "per_bucket"
    """``per_bucket`` (all-reduce each ZeRO bucket in backward) or ``post_backward`` (``FTBRIDGE_SYNC_MODE``)."""

    cross_replica_bucket_bytes: int = 25 << 20
    """Per-bucket mode: smallest cross-replica message, bytes; 0: one per parameter fragment
    (``FTBRIDGE_CROSS_REPLICA_BUCKET_BYTES``)."""

    checksum_every: int = 100
    """Log a SHA-256 checksum of the full parameters every this many steps; 0: never (``FTBRIDGE_CHECKSUM_EVERY``)."""

    guard_every: int = 100
    """Compare the groups' state fingerprints every this many committed steps; 0: never
    (:mod:`ftbridge.guard`; ``FTBRIDGE_GUARD_EVERY``)."""

    guard_action: str = "heal"
    """On a guard mismatch: ``heal`` (outvoted groups discard and heal) or ``stop`` (every group raises
    ``ReplicaDivergenceError``) (``FTBRIDGE_GUARD_ACTION``)."""

    guard_on_tie: str = "stop"
    """On a guard mismatch with no majority: ``stop`` (raise ``ReplicaDivergenceError``) or ``flag`` (log and
    train on) (``FTBRIDGE_GUARD_ON_TIE``)."""

    event_log: Optional[str] = None
    """JSON-lines event log path; ``{replica_group}``, ``{group_rank}`` substituted (``FTBRIDGE_EVENT_LOG``)."""

    cross_replica_backend: str = "auto"
    """``auto``, ``nccl`` or ``gloo``, the same on every rank (``FTBRIDGE_CROSS_REPLICA_BACKEND``)."""

    comm_hook: str = "no"
    """Cross-replica all-reduce hook: ``no``, ``fp16``, ``bf16``, ``power_sgd``, ``batched_power_sgd``
    (:mod:`ftbridge.comm_hooks`; ``FTBRIDGE_COMM_HOOK``)."""

    comm_wrapper: str = "no"
    """``fp16`` or ``bf16`` cast around a PowerSGD hook, ``no`` for none (``FTBRIDGE_COMM_WRAPPER``)."""

    comm_state_option: Mapping[str, Any] = field(default_factory=dict)
    """PowerSGD options under PyTorch's names, a JSON object (``FTBRIDGE_COMM_STATE_OPTION``)."""

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
        """A validated config: each field from ``overrides`` (``None``: not given), then ``environ`` (default
        ``os.environ``), then its default. Timeouts accept a ``timedelta`` or a number of seconds.

        Raises:
            ValueError: an unknown field, an unparsable environment variable, or any rule of :meth:`validate`.
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
        """Timeout of torchft's own calls (``should_commit``, heal fetches): 2 x ``cross_replica_timeout``."""
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
        """Longest wait for the step in flight after a SIGTERM, 2 x ``cross_replica_timeout``; then exit 143."""
        return 2 * self.cross_replica_timeout

    @property
    def heal_deadline(self) -> timedelta:
        """Overall deadline of one heal fetch: :attr:`heal_timeout`, else :attr:`torchft_timeout`."""
        return self.heal_timeout or self.torchft_timeout

    def torchft_environ(self) -> dict[str, str]:
        """torchft's ``TORCHFT_*`` variables for these settings, in whole seconds rounded up, at least 1 s."""
        return {
            "TORCHFT_TIMEOUT_SEC": whole_seconds(self.torchft_timeout),
            "TORCHFT_QUORUM_TIMEOUT_SEC": whole_seconds(self.quorum_timeout),
            "TORCHFT_CONNECT_TIMEOUT_SEC": whole_seconds(self.connect_timeout),
            "TORCHFT_QUORUM_RETRIES": str(self.quorum_retries),
        }
