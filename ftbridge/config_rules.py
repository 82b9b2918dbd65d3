"""The rules every :class:`ftbridge.config.FTBridgeConfig` must satisfy, checked once at resolve time.

Each rule raises ``ValueError`` naming the bad value, its variable or flag where there is one, and the fix, before
any process group or engine exists: :func:`check_topology`, :func:`check_timeouts` (the timeout hierarchy),
:func:`check_transport`. The readers below them parse a value before the rules see it.
Why: docs/concepts.md, "The timeout hierarchy".
"""

from __future__ import annotations

import math
import urllib.parse
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Mapping, Optional

if TYPE_CHECKING:  # the rules take the config; the config module imports the rules
    from ftbridge.config import FTBridgeConfig

SYNC_MODES = ("per_bucket", "post_backward")
"""Where the cross-replica all-reduce of a step starts (``FTBridgeConfig.sync_mode``)."""
CROSS_REPLICA_BACKENDS = ("auto", "nccl", "gloo")
"""Backends of the cross-replica process group (``FTBridgeConfig.cross_replica_backend``)."""
GUARD_ACTIONS = ("heal", "stop")
"""What the divergence guard does with an outvoted group (``FTBridgeConfig.guard_action``)."""
GUARD_TIE_ACTIONS = ("stop", "flag")
"""What the divergence guard does without a majority (``FTBridgeConfig.guard_on_tie``)."""
MIN_TOKEN_CHARS = 16
"""Shortest job token accepted (``FTBridgeConfig.job_token``)."""


def validate(cfg: FTBridgeConfig) -> None:
    """Check every rule for ``cfg``; raise ``ValueError`` for the first one it breaks."""
    check_topology(cfg)
    check_timeouts(cfg)
    check_transport(cfg)


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def check_topology(cfg: FTBridgeConfig) -> None:
    """Replica group id and count, spare index, group rank and size, ``min_replicas``, slots, ``init_sync``, the
    lighthouse address; ``ValueError`` for a value outside its range."""
    _need(cfg.replica_group_id >= 0,
          f"replica_group_id={cfg.replica_group_id} is negative; use 0, 1, 2, ...")
    _need(cfg.num_replica_groups >= 1,
          f"num_replica_groups={cfg.num_replica_groups} must be at least 1")
    _need(cfg.spare_index >= -1,
          f"spare_index={cfg.spare_index} must be -1 (an active group) or a spare's index 0, 1, ...")
    _need(cfg.spare_index < 0 or cfg.num_replica_groups >= 2,
          f"spare_index={cfg.spare_index} with num_replica_groups={cfg.num_replica_groups}: a spare replaces "
          "one of several groups and heals from another; plan at least 2 groups")
    _need(cfg.group_size >= 1, f"group_size={cfg.group_size} must be at least 1")
    _need(0 <= cfg.group_rank < cfg.group_size,
          f"group_rank={cfg.group_rank} is outside the replica group of size {cfg.group_size}; "
          "launch with torchrun (ftbridge-run), which sets RANK and WORLD_SIZE")
    _need(0 <= cfg.local_group_size <= cfg.group_size,
          f"local_group_size={cfg.local_group_size} (LOCAL_WORLD_SIZE) is outside 0..group_size={cfg.group_size}")
    _need(1 <= cfg.min_replicas,
          f"min_replicas={cfg.min_replicas} must be at least 1")
    _need(cfg.min_replicas <= cfg.num_replica_groups,
          f"min_replicas={cfg.min_replicas} exceeds num_replica_groups={cfg.num_replica_groups}: "
          "no step could ever commit; lower min_replicas or launch more groups")
    _need(cfg.slots == 0 or cfg.slots >= cfg.num_replica_groups,
          f"slots={cfg.slots} (FTBRIDGE_SLOTS) is fewer than num_replica_groups={cfg.num_replica_groups}: each "
          f"group needs a slot of its own; use slots={cfg.num_replica_groups}, or 0 to train without slots")
    _need(not cfg.init_sync,
          "init_sync=True (FTBRIDGE_INIT_SYNC) is not supported: torchft heals every group but one at each step-0 "
          "quorum and still counts the healing groups among the participants, so ftbridge's commit agreement "
          "discards that step, and step 0 never commits; build the model from one seed on every group (set the "
          "seed before constructing it) and unset FTBRIDGE_INIT_SYNC. The event log's start checksums show "
          "whether the groups start alike")
    _need(is_host_port_url(cfg.lighthouse),
          f"lighthouse={cfg.lighthouse!r} is not an address like http://HOST:PORT; "
          "pass the address printed by 'ftbridge-lighthouse serve'")


def check_timeouts(cfg: FTBridgeConfig) -> None:
    """Every timeout positive, and the timeout hierarchy; ``ValueError`` for a bad value or two in the wrong order."""
    for name in ("cross_replica_timeout", "in_group_timeout", "quorum_timeout",
                 "connect_timeout", "heartbeat_interval", "peer_watch_poll", "peer_watch_freeze_discard"):
        value = getattr(cfg, name)
        _need(value.total_seconds() > 0, f"{name}={value.total_seconds()} s must be positive")
    _need(cfg.heal_timeout is None or cfg.heal_timeout.total_seconds() > 0,
          f"heal_timeout={cfg.heal_timeout and cfg.heal_timeout.total_seconds()} s "
          "(FTBRIDGE_HEAL_TIMEOUT_S) must be positive; unset it to use twice the cross-replica timeout")
    _need(cfg.restart_peer_wait.total_seconds() >= 0,
          f"restart_peer_wait={cfg.restart_peer_wait.total_seconds()} s must be 0 (never wait) or positive")
    _need(cfg.stand_aside.total_seconds() >= 0,
          f"stand_aside={cfg.stand_aside.total_seconds()} s (FTBRIDGE_STAND_ASIDE_S) must be 0 (never stand "
          "aside) or positive")
    cross = cfg.cross_replica_timeout.total_seconds()
    _need(cfg.heartbeat_interval < cfg.cross_replica_timeout,
          f"heartbeat_interval={cfg.heartbeat_interval.total_seconds()} s must be below "
          f"cross_replica_timeout={cross} s")
    _need(cfg.peer_watch_poll < cfg.cross_replica_timeout,
          f"peer_watch_poll={cfg.peer_watch_poll.total_seconds()} s (FTBRIDGE_PEER_WATCH_POLL_MS) must be "
          f"below cross_replica_timeout={cross} s, or the watch never looks")
    _need(cfg.peer_watch_freeze_discard > cfg.peer_watch_poll,
          f"peer_watch_freeze_discard={cfg.peer_watch_freeze_discard.total_seconds()} s "
          f"(FTBRIDGE_PEER_WATCH_FREEZE_DISCARD_MS) must be above peer_watch_poll="
          f"{cfg.peer_watch_poll.total_seconds()} s (the freeze clock ticks once per poll)")
    _need(cfg.cross_replica_timeout < cfg.in_group_timeout,
          f"cross_replica_timeout={cross} s is not below "
          f"in_group_timeout={cfg.in_group_timeout.total_seconds()} s: the in-group watchdog would "
          "kill the surviving groups before a cross-replica failure is noticed; lower "
          "cross_replica_timeout or raise in_group_timeout")
    _need(cfg.cross_replica_timeout <= cfg.quorum_timeout,
          f"quorum_timeout={cfg.quorum_timeout.total_seconds()} s is below "
          f"cross_replica_timeout={cross} s; a quorum must be "
          "allowed at least as long as one cross-replica collective")
    _need(cfg.quorum_retries >= 0, f"quorum_retries={cfg.quorum_retries} must be >= 0")


def check_transport(cfg: FTBridgeConfig) -> None:
    """Addresses, ports, the job token, the event log path, sync mode, comm hooks and the divergence guard;
    ``ValueError`` for a bad value."""
    if cfg.event_log:
        try:
            cfg.event_log_path()
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(
                f"event_log={cfg.event_log!r} has an unknown placeholder ({e}); only {{replica_group}} and "
                "{group_rank} are substituted"
            ) from None
    _need(cfg.job_token is None or len(cfg.job_token) >= MIN_TOKEN_CHARS,
          f"job_token (FTBRIDGE_JOB_TOKEN) has {len(cfg.job_token or '')} characters; use at least "
          f"{MIN_TOKEN_CHARS}, e.g. from: python -c 'import secrets; print(secrets.token_hex(16))'")
    _need(0 <= cfg.manager_port < 65536,
          f"manager_port={cfg.manager_port} is not a port; use 0 for a free one")
    _need(cfg.metrics_port is None or 0 <= cfg.metrics_port < 65536,
          f"metrics_port={cfg.metrics_port} is not a port; use 0 for a free one, or unset "
          "FTBRIDGE_METRICS_PORT for no metrics server")
    _need(cfg.cross_replica_bucket_bytes >= 0,
          f"cross_replica_bucket_bytes={cfg.cross_replica_bucket_bytes} must be >= 0 (0: one message per bucket)")
    _need(cfg.checksum_every >= 0,
          f"checksum_every={cfg.checksum_every} must be >= 0 (0: never write a parameter checksum)")
    _need(cfg.guard_every >= 0,
          f"guard_every={cfg.guard_every} must be >= 0 (0: never compare replica fingerprints)")
    _need(cfg.guard_action in GUARD_ACTIONS,
          f"guard_action={cfg.guard_action!r} is not one of {GUARD_ACTIONS} (FTBRIDGE_GUARD_ACTION)")
    _need(cfg.guard_on_tie in GUARD_TIE_ACTIONS,
          f"guard_on_tie={cfg.guard_on_tie!r} is not one of {GUARD_TIE_ACTIONS} (FTBRIDGE_GUARD_ON_TIE)")
    _need(cfg.lighthouse_probe_timeout > timedelta(0),
          f"lighthouse_probe_timeout={cfg.lighthouse_probe_timeout.total_seconds() * 1000:g} ms must be positive "
          "(FTBRIDGE_LIGHTHOUSE_PROBE_TIMEOUT_MS)")
    _need(cfg.cross_replica_backend in CROSS_REPLICA_BACKENDS,
          f"cross_replica_backend={cfg.cross_replica_backend!r} (FTBRIDGE_CROSS_REPLICA_BACKEND) is not one of "
          f"{CROSS_REPLICA_BACKENDS}; auto picks NCCL or gloo from the machine (ftbridge.device)")
    _need(cfg.sync_mode in SYNC_MODES,
          f"sync_mode={cfg.sync_mode!r} is not one of {SYNC_MODES}")
    from ftbridge import comm_hooks

    comm_hooks.validate(cfg.comm_hook, cfg.comm_wrapper, cfg.comm_state_option)
    _need(bool(cfg.heal_bind) and cfg.heal_bind not in ("0.0.0.0", "::", "[::]"),
          f"heal_bind={cfg.heal_bind!r} (FTBRIDGE_HEAL_BIND) is not an address peers can dial; "
          "give this node's address "
          "(127.0.0.1 on one machine, the private-network address across machines)")


def is_host_port_url(url: str) -> bool:
    """Whether ``url`` is ``http(s)://HOST:PORT`` with both parts present (the lighthouse address form)."""
    try:
        parts = urllib.parse.urlsplit(url)
        return parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port is not None
    except ValueError:
        return False


# Reading a value: how a setting is spelt in the environment or given as an override.


def first_set(environ: Mapping[str, str], *names: str) -> Optional[str]:
    """First non-empty value among ``names`` in ``environ``, else ``None``."""
    for name in names:
        value = environ.get(name)
        if value not in (None, ""):
            return value
    return None


TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
"""How a boolean setting is spelt in the environment or as a string override (any case)."""


def parse_env(kind: type, raw: str, name: str) -> Any:
    """Environment variable ``name``'s text ``raw`` as ``kind`` (``bool`` takes the words above, any case).

    Raises:
        ValueError: ``raw`` is not a ``kind``, naming the variable and the fix.
    """
    try:
        if kind is bool:
            low = raw.strip().lower()
            if low in TRUE_WORDS + FALSE_WORDS:
                return low in TRUE_WORDS
            raise ValueError(raw)
        return kind(raw)
    except ValueError:
        raise ValueError(
            f"environment variable {name}={raw!r} is not a valid {kind.__name__}; "
            f"set it to a {kind.__name__} or unset it"
        ) from None


def check_override(kind: Any, value: Any, name: str) -> Any:
    """Override ``value`` of setting ``name`` checked against its kind; a ``bool`` or ``int`` setting also takes
    its variable's strings (``"2"``, ``"no"``); other kinds pass through.

    Raises:
        ValueError: a value of another type, naming the setting and what it takes.
    """
    if kind is bool:
        if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
            return bool(value)
        if isinstance(value, str):
            low = value.strip().lower()
            if low in TRUE_WORDS + FALSE_WORDS:
                return low in TRUE_WORDS
        raise ValueError(f"ftbridge setting {name}={value!r} is not a boolean; pass True or False "
                         "(or 1/0, or one of the strings true/false, yes/no, on/off)")
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
        raise ValueError(f"ftbridge setting {name}={value!r} is not an integer; pass a whole number such as 2")
    return value


def parse_json_object(raw: str, name: str) -> dict:
    """``raw`` (the text of setting or variable ``name``) as a JSON object; ``ValueError`` for anything else."""
    import json

    try:
        value = json.loads(raw)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ValueError(f"{name}={raw!r} is not a JSON object; give one like "
                         """'{"matrix_approximation_rank": 2}', or unset it""")
    return value


def as_timedelta(value: Any, name: str, scale: float = 1.0) -> timedelta:
    """``value`` (a timedelta, or a number of seconds times ``scale``) as a timedelta."""
    if isinstance(value, timedelta):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ValueError(f"{name}={value!r} is not a finite number; give a positive duration")
        try:
            return timedelta(seconds=value * scale)
        except OverflowError:
            raise ValueError(f"{name}={value!r} is too large for a duration; give a realistic timeout") from None
    raise ValueError(f"{name}={value!r} must be a datetime.timedelta or a number of seconds")


def whole_seconds(value: timedelta) -> str:
    """``value`` rounded up to whole seconds, at least 1, as torchft's ``TORCHFT_*_SEC`` variables take it."""
    return str(max(1, math.ceil(value.total_seconds())))
