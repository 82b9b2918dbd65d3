"""Topology and settings of one ftbridge process, resolved once.

Every setting is resolved with one precedence, written down here and nowhere
else: **explicit argument, then environment variable, then default**. The
environment variables read are ``FTBRIDGE_*`` plus the ones torchft and
torchrun already define (``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS``,
``TORCHFT_LIGHTHOUSE``, ``TORCHFT_*_SEC``, ``TORCHFT_QUORUM_RETRIES``,
``TORCHFT_MANAGER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``); where both an
``FTBRIDGE_*`` and a torchft name exist, the ``FTBRIDGE_*`` one wins.

Timeout hierarchy (checked by :meth:`FTBridgeConfig.validate`)::

    heartbeat_interval < cross_replica_timeout < in_group_timeout
    cross_replica_timeout <= quorum_timeout

The cross-replica timeout bounds every collective between replica groups; it
must fire before the in-group watchdog (DeepSpeed's own process group
timeout), otherwise a dead peer group makes the in-group collective of the
*survivors* time out first and kills them.

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

    Build it with :meth:`resolve` (argument, then environment, then default);
    the constructor itself does not read the environment. :meth:`validate`
    runs in :meth:`resolve` and raises ``ValueError`` naming the bad value and
    the fix, before any process group or engine exists.
    """

    replica_group_id: int = 0
    """Id of this replica group, 0-based, stable across restarts of the group
    (``FTBRIDGE_REPLICA_GROUP_ID`` / ``REPLICA_GROUP_ID``)."""

    num_replica_groups: int = 1
    """Number of replica groups the job is planned for; used for data
    sharding and logs, the live count comes from the quorum
    (``FTBRIDGE_NUM_REPLICA_GROUPS`` / ``NUM_REPLICA_GROUPS``)."""

    spare_index: int = -1
    """-1: an active replica group. ``K >= 0``: a warm spare (``ftbridge-run --spare-index K``) that initialises
    fully, then stands by outside the quorum until a replica group dies and takes over its id (see
    :mod:`ftbridge.spare`); spare ``K`` acts ``K`` stagger periods after spare 0 (``FTBRIDGE_SPARE_INDEX``)."""

    group_rank: int = 0
    """Rank of this process inside its replica group (``RANK`` from torchrun)."""

    group_size: int = 1
    """Ranks per replica group; ZeRO shards across exactly these ranks
    (``WORLD_SIZE`` from torchrun)."""

    lighthouse: str = "http://127.0.0.1:29510"
    """Address of the torchft lighthouse (``TORCHFT_LIGHTHOUSE``)."""

    min_replicas: int = 1
    """Fewest replica groups that may commit a step (``FTBRIDGE_MIN_REPLICAS``)."""

    slots: int = 0
    """Failure-transparent training (:mod:`ftbridge.slots`): the job's fixed data-parallel slots, at least
    :attr:`num_replica_groups` (usually equal to it). Each step then trains on every slot's micro-batches
    whichever groups are alive, and divides the cross-replica sum by the slots, not by the live groups;
    the training loop iterates :meth:`ftbridge.engine.FaultTolerantEngine.units`. 0: off, a failure
    shrinks the global batch to the live groups (``FTBRIDGE_SLOTS``)."""

    cross_replica_timeout: timedelta = timedelta(seconds=10)
    """Bound on every collective between replica groups (``FTBRIDGE_CROSS_REPLICA_TIMEOUT_S``).
    torchft's own calls (``should_commit``, heal transfers) get twice this
    (:attr:`torchft_timeout`): they wait for the group's slowest rank, which
    may be waiting out a cross-replica all-reduce with a hung peer. ftbridge
    sets ``TORCHFT_TIMEOUT_SEC`` to that doubled value itself, so it is not
    read as this setting."""

    in_group_timeout: timedelta = timedelta(seconds=60)
    """Timeout of the replica group's own torch.distributed world, used by
    DeepSpeed's collectives (``FTBRIDGE_IN_GROUP_TIMEOUT_S``)."""

    quorum_timeout: timedelta = timedelta(seconds=30)
    """How long one step's quorum call may take, torchft's retries included:
    also the longest lighthouse outage (restart) a job rides out, less the
    lighthouse's join timeout and about 2 s to reconnect; 30 s covered a 25 s
    outage (``docs/lighthouse.md``)
    (``FTBRIDGE_QUORUM_TIMEOUT_S`` / ``TORCHFT_QUORUM_TIMEOUT_SEC``)."""

    connect_timeout: timedelta = timedelta(seconds=10)
    """Timeout to open gRPC connections to the lighthouse and managers
    (``FTBRIDGE_CONNECT_TIMEOUT_S`` / ``TORCHFT_CONNECT_TIMEOUT_SEC``)."""

    heartbeat_interval: timedelta = timedelta(milliseconds=100)
    """Interval of the manager's heartbeats to the lighthouse
    (``FTBRIDGE_HEARTBEAT_INTERVAL_MS``)."""

    restart_peer_wait: timedelta = timedelta(seconds=30)
    """How long a replica group restarted by torchrun, with nothing to start
    from (step 0: no heal, no checkpoint), refuses to commit steps alone while
    it waits for a live peer to heal from (``FTBRIDGE_RESTART_PEER_WAIT_S``;
    0: never wait). Without it a group that restarts while the lighthouse is
    restarting can get a quorum of its own and train from scratch until the
    others come back. After the wait with no peer it exits with
    ``NoPeerToHealFrom``: the others have finished or died, and training
    alone from step 0 would make a second, different model; resume from a
    checkpoint instead. Ignored with ``num_replica_groups`` 1."""

    stand_aside: timedelta = timedelta(seconds=30)
    """The first pause of a replica group cut off from its peers but not from the
    lighthouse: when group rank 0 finds the quorum's store silent in two
    quorums in a row, the group stops heartbeating for this long so that the
    others get quorums without it, then comes back and heals; the pause
    doubles each time until the group commits again, up to 8x and at most
    half of :attr:`restart_peer_wait`
    (:class:`ftbridge.manager.stand_aside.StandAside`;
    ``FTBRIDGE_STAND_ASIDE_S``; 0: never stand aside)."""

    peer_watch: bool = True
    """Cut a hung peer off when the lighthouse declares it dead, instead of
    waiting out :attr:`cross_replica_timeout`: a cross-replica wait longer
    than :attr:`peer_watch_poll` reads the lighthouse's status every poll and
    discards the step once a member of the step's quorum has no heartbeat
    (``FTBRIDGE_PEER_WATCH``; CPU process groups only; see
    :mod:`ftbridge.manager.quorum_watch`). Costs a copy of each all-reduced message."""

    peer_watch_poll: timedelta = timedelta(milliseconds=100)
    """How long a cross-replica wait lasts before the peer watch first reads
    the lighthouse's status, and how often it reads it then
    (``FTBRIDGE_PEER_WATCH_POLL_MS``)."""

    peer_watch_freeze_discard: timedelta = timedelta(seconds=1)
    """A rank frozen (SIGSTOP, a stuck host) this long during a step discards
    the step, whatever the lighthouse says when it resumes
    (``FTBRIDGE_PEER_WATCH_FREEZE_DISCARD_MS``). The survivors may have cut it
    off and gone on without it, and the lighthouse may not show that yet; a
    commit then would leave it with a step the others discarded. Keep it
    below the lighthouse's heartbeat timeout minus the heartbeat interval
    (the shortest freeze the lighthouse can declare dead). A discard is
    always safe: the group is one step behind and heals."""

    quorum_retries: int = 5
    """Times one quorum call is tried again: ``quorum_retries + 1`` tries of
    ``quorum_timeout / (quorum_retries + 1)`` each, one at a time, so a
    lighthouse restart does not kill the job; torchft's default 0 does.
    ftbridge makes the tries itself (torchft's manager server then retries
    nothing: a request it retried could not be taken back); with a torchft
    ftbridge does not guard, torchft's manager retries as its own
    ``quorum_retries`` says (``FTBRIDGE_QUORUM_RETRIES`` / ``TORCHFT_QUORUM_RETRIES``)."""

    ride_out_lighthouse_outage: bool = True
    """While the lighthouse does not answer (dead, hung, or behind a link that
    drops its packets) and no replica group has failed, keep committing on the
    last quorum (same quorum id and cross-replica process group), each step
    only after every member agreed on its view; on any failure, wait for the
    lighthouse. Off, every step waits for the lighthouse
    (``FTBRIDGE_RIDE_OUT_LIGHTHOUSE_OUTAGE``; see :mod:`ftbridge.manager.outage`).
    Either way every step ends with the agreement, one all-reduce of
    ``17 x replica groups`` float64 (136 bytes per group) on the cross-replica
    process group (:mod:`ftbridge.manager.commit`)."""

    lighthouse_probe_timeout: timedelta = timedelta(milliseconds=100)
    """A lighthouse that gives no answer to ``GET /status`` within this long
    counts as not answering, and a quorum call in flight is left for a ride
    on the last quorum (``FTBRIDGE_LIGHTHOUSE_PROBE_TIMEOUT_MS``). A connect
    that succeeds proves nothing: a hung lighthouse, or a proxy in front of a
    dead one, accepts connections. An answer that arrives late because this
    process was paused still counts. Too short on a loaded machine costs a
    discarded step now and then, never a split; a hung lighthouse costs
    about this long plus one step."""

    manager_port: int = 0
    """Port of the torchft manager server on group rank 0; 0 picks a free one
    (``FTBRIDGE_MANAGER_PORT`` / ``TORCHFT_MANAGER_PORT``)."""

    heal_bind: str = "127.0.0.1"
    """Address of this node that the other replica groups can dial: the heal
    transport (state served to joining groups) binds to it, and group rank 0
    advertises its torchft manager under it (to its own ranks, the lighthouse
    and healing groups). 127.0.0.1 works on one machine only; across machines
    set the node's address on the private network (``FTBRIDGE_HEAL_BIND``)."""

    metrics_port: Optional[int] = None
    """Port on which each replica group's rank 0 serves Prometheus metrics at
    ``/metrics``, bound to :attr:`heal_bind`; 0 picks a free port (printed at
    start and written to the event log); ``None`` (unset): no metrics server
    (``FTBRIDGE_METRICS_PORT``; see :mod:`ftbridge.metrics`)."""

    heal_timeout: Optional[timedelta] = None
    """Overall deadline of one heal fetch on the joiner: connect, request and
    the whole body, not per read (a donor sending a byte every 0.5 s is cut
    off there); also how long a donor keeps sending one response. ``None``:
    :attr:`torchft_timeout`, the timeout torchft gives the fetch. Raise it for
    states that take longer to cross the network (``FTBRIDGE_HEAL_TIMEOUT_S``)."""

    job_token: Optional[str] = field(default=None, repr=False)
    """Shared secret of the job's ranks (``FTBRIDGE_JOB_TOKEN``; ``ftbridge-run
    --job-token-file``). With it, a donor serves heal state only to requests
    carrying an HMAC of it; without it, anyone who reaches a heal port can
    download the model and optimizer state (keep it on a private network).
    At least 16 characters, e.g. ``python -c 'import secrets;
    print(secrets.token_hex(16))'``. Never printed."""

    local_group_size: int = 0
    """Ranks of this replica group on this node (``LOCAL_WORLD_SIZE`` from
    torchrun; 0: unknown, taken as the whole group). When smaller than
    :attr:`group_size` the group spans nodes, and a joiner's group ranks
    other than 0 accept heal URLs on any host (their donor may sit on another
    node than the donor's manager); rank 0 always checks the host."""

    init_sync: bool = False
    """torchft's heal of every replica group from one peer at step 0 (``FTBRIDGE_INIT_SYNC``): refused
    when true (:func:`ftbridge.config_rules.check_topology` says why). Build the model from one seed on
    every group instead; the event log's start checksums show that the groups start alike."""

    sync_mode: str = "per_bucket"
    """``per_bucket``: all-reduce each reduced ZeRO bucket across replica
    groups as soon as DeepSpeed has reduced it in the group (overlaps with
    backward); ``post_backward``: one all-reduce of the whole partition after
    backward. Either way the messages are fixed by the parameter layout
    (:mod:`ftbridge.zero.messages`). Where a bucket's gradient is not yet the
    step's final one (ZeRO-1/2 with several backward calls per step, bf16
    compact path) ``per_bucket`` sends the same messages after backward,
    logged once (``FTBRIDGE_SYNC_MODE``)."""

    cross_replica_bucket_bytes: int = 25 << 20
    """Per-bucket mode: reduced ZeRO buckets are coalesced until this many
    bytes are ready, then sent in one cross-replica all-reduce (bytes; 0 sends
    every bucket on its own). Default 25 MiB, DDP's ``bucket_cap_mb``: smaller
    messages overlap more of backward but each costs a fixed overhead, which
    on 2 CPU cores outweighs the overlap (``FTBRIDGE_CROSS_REPLICA_BUCKET_BYTES``)."""

    checksum_every: int = 100
    """Write a SHA-256 checksum of the full parameters to the event log every
    this many steps (0: never). It shows replicas identical without a
    checkpoint, but costs a pass over the parameters (about 3 % of a step of
    the main job's model when taken every step; under ZeRO-3 it also gathers
    the parameters). Tests and chaos runs ask for 1 (``FTBRIDGE_CHECKSUM_EVERY``)."""

    guard_every: int = 100
    """Divergence guard: every this many committed steps the replica groups
    compare a SHA-256 fingerprint of each rank's fp32 master partition and
    optimizer state across the cross-replica group (one small all-reduce;
    0: never). A mismatch is logged and handled by :attr:`guard_action`
    (``FTBRIDGE_GUARD_EVERY``); see :mod:`ftbridge.guard`."""

    guard_action: str = "heal"
    """What the divergence guard does on a mismatch: ``heal`` (the groups that
    differ from the state most groups hold discard the step and heal from one
    of them at the next) or ``stop`` (every group raises
    ``ReplicaDivergenceError``: a non-zero exit) (``FTBRIDGE_GUARD_ACTION``)."""

    guard_on_tie: str = "stop"
    """What the divergence guard does when the groups differ and no state is
    held by more than half of them (two groups, or a tie), where nobody can be
    named right: ``stop`` (every group raises ``ReplicaDivergenceError``) or
    ``flag`` (a ``divergence`` event and an ERROR at every check; training
    goes on) (``FTBRIDGE_GUARD_ON_TIE``)."""

    event_log: Optional[str] = None
    """Path of the JSON-lines event log; ``{replica_group}`` and
    ``{group_rank}`` are substituted (``FTBRIDGE_EVENT_LOG``)."""

    cross_replica_backend: str = "auto"
    """Backend of the cross-replica process group: ``auto``, ``nccl`` or ``gloo``
    (``FTBRIDGE_CROSS_REPLICA_BACKEND``). ``auto``: gloo on CPU; on CUDA, NCCL
    when every rank has a GPU of its own, gloo with CUDA tensors when ranks of
    different replica groups share a GPU (one machine with fewer GPUs than
    ranks); see :mod:`ftbridge.device`. Every rank of the job must agree."""

    comm_hook: str = "no"
    """Communication hook of the cross-replica all-reduce, Accelerate's names:
    ``no``, ``fp16``, ``bf16``, ``power_sgd``, ``batched_power_sgd``
    (``FTBRIDGE_COMM_HOOK``); see :mod:`ftbridge.comm_hooks`."""

    comm_wrapper: str = "no"
    """``fp16`` or ``bf16`` cast around a PowerSGD hook; ``no`` for none
    (``FTBRIDGE_COMM_WRAPPER``)."""

    comm_state_option: Mapping[str, Any] = field(default_factory=dict)
    """PowerSGD options under PyTorch's names (``matrix_approximation_rank``,
    ``start_powerSGD_iter``, ...); unset ones take PyTorch's defaults
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

        Those calls wait for the group's slowest rank, which may itself be
        waiting out a cross-replica all-reduce with a hung peer (bounded by
        ``cross_replica_timeout``); with equal timeouts ``should_commit``
        expired first and killed the survivor's group rank 0.
        """
        return 2 * self.cross_replica_timeout

    @property
    def vote_timeout(self) -> timedelta:
        """Bound of the per-quorum reconfigure vote on the primary's store: ``cross_replica_timeout / 4``.

        Well below the cross-replica timeout, which bounds the other ranks'
        ``should_commit`` while the quorum thread votes; past it the vote
        counts as failed and torchft's own decision stands.
        """
        return self.cross_replica_timeout / 4

    @property
    def store_call_timeout(self) -> timedelta:
        """Bound of one call to a peer's TCPStore (connect, get, delete): 2 x :attr:`vote_timeout`.

        c10d's store client blocks without a timeout on a SIGSTOPped host,
        so such calls run in a helper thread bounded by this
        (:func:`ftbridge.manager.futures.call_bounded`).
        """
        return 2 * self.vote_timeout

    @property
    def sigterm_grace(self) -> timedelta:
        """After a SIGTERM, longest wait for the step in flight to finish: 2 x ``cross_replica_timeout``.

        The step may wait out one cross-replica timeout with a dead peer and
        then a ``should_commit`` bounded by it; past this the rank exits
        (status 143) rather than hold its group's quorum.
        """
        return 2 * self.cross_replica_timeout

    @property
    def heal_deadline(self) -> timedelta:
        """Overall deadline of one heal fetch: :attr:`heal_timeout`, else :attr:`torchft_timeout`."""
        return self.heal_timeout or self.torchft_timeout

    def torchft_environ(self) -> dict[str, str]:
        """torchft's environment variables for these settings.

        torchft's ``Manager`` lets its environment variables override its
        constructor arguments; ftbridge sets them to the resolved values so
        both agree (``TORCHFT_TIMEOUT_SEC`` is :attr:`torchft_timeout`, twice
        the cross-replica timeout). torchft reads whole seconds: fractions are
        rounded *up* (never shorter than configured), with a minimum of 1 s.
        """
        return {
            "TORCHFT_TIMEOUT_SEC": whole_seconds(self.torchft_timeout),
            "TORCHFT_QUORUM_TIMEOUT_SEC": whole_seconds(self.quorum_timeout),
            "TORCHFT_CONNECT_TIMEOUT_SEC": whole_seconds(self.connect_timeout),
            "TORCHFT_QUORUM_RETRIES": str(self.quorum_retries),
        }
