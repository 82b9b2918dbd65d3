"""Unit tests for ftbridge.config: precedence, env parsing, every validation rule."""

import dataclasses
import re
from datetime import timedelta

import pytest

from ftbridge.config import FTBridgeConfig
from ftbridge.config_rules import SYNC_MODES


def resolve(env=None, **kw):
    """Resolve against an explicit environment so the test process's own env never leaks in."""
    return FTBridgeConfig.resolve(environ={} if env is None else env, **kw)


# -- defaults and construction ------------------------------------------------

def test_defaults_resolve_and_validate():
    cfg = resolve()
    assert cfg == FTBridgeConfig()
    assert cfg.replica_group_id == 0 and cfg.num_replica_groups == 1
    assert cfg.group_rank == 0 and cfg.group_size == 1
    assert cfg.lighthouse == "http://127.0.0.1:29510"
    assert cfg.cross_replica_timeout == timedelta(seconds=10)
    assert cfg.in_group_timeout == timedelta(seconds=60)
    assert cfg.quorum_timeout == timedelta(seconds=30)
    assert cfg.connect_timeout == timedelta(seconds=10)
    assert cfg.heartbeat_interval == timedelta(milliseconds=100)
    assert cfg.quorum_retries == 5 and cfg.manager_port == 0
    assert cfg.heal_bind == "127.0.0.1" and cfg.init_sync is False
    assert cfg.sync_mode == "per_bucket" and cfg.event_log is None
    FTBridgeConfig().validate()  # the defaults themselves satisfy every rule


def test_config_is_frozen_and_keyword_only():
    cfg = resolve()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.replica_group_id = 3
    with pytest.raises(TypeError):
        FTBridgeConfig(1)  # positional arguments are refused


def test_env_table_covers_every_field():
    # A field missing from _ENV could never be set from the environment.
    assert set(FTBridgeConfig._ENV) == {f.name for f in dataclasses.fields(FTBridgeConfig)}


def test_resolve_reads_os_environ_when_no_environ_given(monkeypatch):
    monkeypatch.setenv("FTBRIDGE_REPLICA_GROUP_ID", "3")
    monkeypatch.setenv("FTBRIDGE_NUM_REPLICA_GROUPS", "4")
    cfg = FTBridgeConfig.resolve()
    assert cfg.replica_group_id == 3 and cfg.num_replica_groups == 4


# -- precedence: argument > FTBRIDGE_* > torchft/torchrun name > default -------

@pytest.mark.parametrize(
    "field, ftbridge_env, other_env, arg, env_ft, env_other, expect_arg, expect_ft, expect_other, default",
    [
        ("replica_group_id", "FTBRIDGE_REPLICA_GROUP_ID", "REPLICA_GROUP_ID", 1, "2", "3", 1, 2, 3, 0),
        ("num_replica_groups", "FTBRIDGE_NUM_REPLICA_GROUPS", "NUM_REPLICA_GROUPS", 7, "6", "5", 7, 6, 5, 1),
        ("lighthouse", "FTBRIDGE_LIGHTHOUSE", "TORCHFT_LIGHTHOUSE",
         "http://a:1", "http://b:2", "http://c:3", "http://a:1", "http://b:2", "http://c:3",
         "http://127.0.0.1:29510"),
        ("quorum_timeout", "FTBRIDGE_QUORUM_TIMEOUT_S", "TORCHFT_QUORUM_TIMEOUT_SEC",
         timedelta(seconds=40), "41", "42", timedelta(seconds=40), timedelta(seconds=41),
         timedelta(seconds=42), timedelta(seconds=30)),
        ("connect_timeout", "FTBRIDGE_CONNECT_TIMEOUT_S", "TORCHFT_CONNECT_TIMEOUT_SEC",
         timedelta(seconds=1), "2", "3", timedelta(seconds=1), timedelta(seconds=2), timedelta(seconds=3),
         timedelta(seconds=10)),
        ("quorum_retries", "FTBRIDGE_QUORUM_RETRIES", "TORCHFT_QUORUM_RETRIES", 9, "8", "7", 9, 8, 7, 5),
        ("manager_port", "FTBRIDGE_MANAGER_PORT", "TORCHFT_MANAGER_PORT", 1001, "1002", "1003",
         1001, 1002, 1003, 0),
    ],
)
def test_precedence_argument_then_ftbridge_env_then_torchft_env_then_default(
        field, ftbridge_env, other_env, arg, env_ft, env_other, expect_arg, expect_ft, expect_other, default):
    # Raise the bounds the timeout hierarchy puts on the value under test, so only precedence is tested.
    base = {"num_replica_groups": 10} if field != "num_replica_groups" else {}
    if field != "in_group_timeout":
        base["in_group_timeout"] = timedelta(seconds=100)
    if field == "quorum_timeout":
        base["cross_replica_timeout"] = timedelta(seconds=1)
    if field == "cross_replica_timeout":
        base["quorum_timeout"] = timedelta(seconds=50)
    both = {ftbridge_env: env_ft, other_env: env_other}

    assert getattr(resolve(both, **{field: arg}, **base), field) == expect_arg
    assert getattr(resolve(both, **base), field) == expect_ft
    assert getattr(resolve({other_env: env_other}, **base), field) == expect_other
    assert getattr(resolve({}, **base), field) == default


@pytest.mark.parametrize("field, env, raw, value, default", [
    ("group_rank", "RANK", "2", 2, 0),
    ("group_size", "WORLD_SIZE", "4", 4, 1),
    ("min_replicas", "FTBRIDGE_MIN_REPLICAS", "2", 2, 1),
    ("in_group_timeout", "FTBRIDGE_IN_GROUP_TIMEOUT_S", "90", timedelta(seconds=90), timedelta(seconds=60)),
    ("heartbeat_interval", "FTBRIDGE_HEARTBEAT_INTERVAL_MS", "250", timedelta(milliseconds=250),
     timedelta(milliseconds=100)),
    ("heal_bind", "FTBRIDGE_HEAL_BIND", "10.0.0.7", "10.0.0.7", "127.0.0.1"),
    ("peer_watch", "FTBRIDGE_PEER_WATCH", "false", False, True),
    ("sync_mode", "FTBRIDGE_SYNC_MODE", "post_backward", "post_backward", "per_bucket"),
    ("event_log", "FTBRIDGE_EVENT_LOG", "/tmp/ev.jsonl", "/tmp/ev.jsonl", None),
    ("checksum_every", "FTBRIDGE_CHECKSUM_EVERY", "1", 1, 100),
])
def test_single_env_name_fields(field, env, raw, value, default):
    base = {"group_size": 8, "num_replica_groups": 4}
    if field == "group_size":
        base = {"num_replica_groups": 4}
    assert getattr(resolve({env: raw}, **base), field) == value
    assert getattr(resolve({}, **base), field) == default


def test_argument_beats_env_for_single_env_fields():
    env = {"RANK": "1", "WORLD_SIZE": "2", "FTBRIDGE_SYNC_MODE": "per_bucket", "FTBRIDGE_PEER_WATCH": "1",
           "FTBRIDGE_HEAL_BIND": "10.0.0.1", "FTBRIDGE_EVENT_LOG": "/env.jsonl"}
    cfg = resolve(env, group_rank=2, group_size=3, sync_mode="post_backward", peer_watch=False,
                  heal_bind="127.0.0.2", event_log="/arg.jsonl")
    assert (cfg.group_rank, cfg.group_size, cfg.sync_mode) == (2, 3, "post_backward")
    # peer_watch=False is an explicit argument (not None) and must beat FTBRIDGE_PEER_WATCH=1.
    assert cfg.peer_watch is False
    assert (cfg.heal_bind, cfg.event_log) == ("127.0.0.2", "/arg.jsonl")


def test_none_argument_means_not_given():
    cfg = resolve({"FTBRIDGE_REPLICA_GROUP_ID": "2", "NUM_REPLICA_GROUPS": "3"},
                  replica_group_id=None, num_replica_groups=None, event_log=None)
    assert cfg.replica_group_id == 2 and cfg.num_replica_groups == 3 and cfg.event_log is None


def test_empty_env_value_counts_as_unset():
    # An empty FTBRIDGE_* name falls through to the torchft name, an empty last name to the default.
    cfg = resolve({"FTBRIDGE_REPLICA_GROUP_ID": "", "REPLICA_GROUP_ID": "4", "NUM_REPLICA_GROUPS": "5",
                   "FTBRIDGE_HEAL_BIND": "", "RANK": ""})
    assert cfg.replica_group_id == 4
    assert cfg.heal_bind == "127.0.0.1" and cfg.group_rank == 0


# -- parsing of environment values -------------------------------------------

@pytest.mark.parametrize("raw", ["1", "true", "TRUE", "Yes", "on", " true "])
def test_bool_env_true_spellings(raw):
    assert resolve({"FTBRIDGE_RIDE_OUT_LIGHTHOUSE_OUTAGE": raw}).ride_out_lighthouse_outage is True


@pytest.mark.parametrize("raw", ["0", "false", "False", "no", "OFF"])
def test_bool_env_false_spellings(raw):
    assert resolve({"FTBRIDGE_RIDE_OUT_LIGHTHOUSE_OUTAGE": raw}).ride_out_lighthouse_outage is False


@pytest.mark.parametrize("env, raw, kind", [
    ("FTBRIDGE_REPLICA_GROUP_ID", "one", "int"),
    ("REPLICA_GROUP_ID", "1.5", "int"),
    ("WORLD_SIZE", "2x", "int"),
    ("FTBRIDGE_QUORUM_RETRIES", "many", "int"),
    ("TORCHFT_MANAGER_PORT", "http", "int"),
    ("FTBRIDGE_CROSS_REPLICA_TIMEOUT_S", "10s", "float"),
    ("TORCHFT_QUORUM_TIMEOUT_SEC", "thirty", "float"),
    ("FTBRIDGE_HEARTBEAT_INTERVAL_MS", "100ms", "float"),
    ("FTBRIDGE_PEER_WATCH", "maybe", "bool"),
    ("FTBRIDGE_PEER_WATCH", "2", "bool"),
])
def test_bad_env_value_names_the_variable(env, raw, kind):
    with pytest.raises(ValueError) as err:
        resolve({env: raw})
    msg = str(err.value)
    assert env in msg and repr(raw) in msg and kind in msg


def test_bad_env_value_names_the_variable_actually_read():
    # FTBRIDGE_* wins, so a bad torchft name underneath it is never parsed...
    assert resolve({"FTBRIDGE_QUORUM_RETRIES": "3", "TORCHFT_QUORUM_RETRIES": "bad"}).quorum_retries == 3
    # ...and when only the torchft name is set, the error names it, not the FTBRIDGE_* one.
    with pytest.raises(ValueError, match="TORCHFT_QUORUM_RETRIES='bad'"):
        resolve({"TORCHFT_QUORUM_RETRIES": "bad"})


def test_fractional_seconds_and_milliseconds_from_env():
    cfg = resolve({"FTBRIDGE_CROSS_REPLICA_TIMEOUT_S": "2.5", "FTBRIDGE_HEARTBEAT_INTERVAL_MS": "12.5"})
    assert cfg.cross_replica_timeout == timedelta(milliseconds=2500)
    assert cfg.heartbeat_interval == timedelta(microseconds=12500)


@pytest.mark.parametrize("env, raw", [
    ("FTBRIDGE_CROSS_REPLICA_TIMEOUT_S", "inf"),
    ("FTBRIDGE_IN_GROUP_TIMEOUT_S", "nan"),
    ("FTBRIDGE_HEARTBEAT_INTERVAL_MS", "1e300"),
])
def test_non_finite_timeout_env_names_the_variable(env, raw):
    with pytest.raises(ValueError) as err:
        resolve({env: raw})
    assert env in str(err.value)


# -- overrides: unknown names, timedelta/number handling ---------------------

def test_unknown_override_is_refused_with_the_valid_names():
    with pytest.raises(ValueError) as err:
        resolve(replica_id=1, cross_replica_timout=3)
    msg = str(err.value)
    assert "'cross_replica_timout'" in msg and "'replica_id'" in msg
    assert "replica_group_id" in msg and "cross_replica_timeout" in msg  # the valid names are listed


def test_unknown_override_refused_even_when_none():
    with pytest.raises(ValueError, match="'bogus'"):
        resolve(bogus=None)


@pytest.mark.parametrize("given, expect", [
    (3, timedelta(seconds=3)),
    (2.5, timedelta(milliseconds=2500)),
    (timedelta(milliseconds=1500), timedelta(milliseconds=1500)),
])
def test_timeout_override_accepts_timedelta_or_seconds(given, expect):
    cfg = resolve(cross_replica_timeout=given)
    assert isinstance(cfg.cross_replica_timeout, timedelta)
    assert cfg.cross_replica_timeout == expect


def test_heartbeat_override_number_is_seconds_not_milliseconds():
    # Only the env name carries the _MS unit; in Python every timeout number is seconds.
    assert resolve(heartbeat_interval=0.05).heartbeat_interval == timedelta(milliseconds=50)


@pytest.mark.parametrize("bad", ["10", True, [10], object()])
def test_timeout_override_of_wrong_type_is_refused(bad):
    with pytest.raises(ValueError) as err:
        resolve(quorum_timeout=bad)
    assert f"quorum_timeout={bad!r}" in str(err.value) and "timedelta" in str(err.value)


# -- validation: every rule names the bad value ------------------------------

@pytest.mark.parametrize("kwargs, needle", [
    (dict(replica_group_id=-1), "replica_group_id=-1"),
    (dict(num_replica_groups=0), "num_replica_groups=0"),
    (dict(group_size=0), "group_size=0"),
    (dict(group_rank=-1, group_size=2), "group_rank=-1"),
    (dict(group_rank=2, group_size=2), "group_rank=2"),
    (dict(min_replicas=0), "min_replicas=0"),
    (dict(min_replicas=3, num_replica_groups=2), "min_replicas=3 exceeds num_replica_groups=2"),
    (dict(lighthouse="localhost:29510"), "lighthouse='localhost:29510'"),
    (dict(lighthouse="http://localhost"), "lighthouse='http://localhost'"),
    (dict(lighthouse="https://lighthouse"), "lighthouse='https://lighthouse'"),
    (dict(lighthouse="grpc://h:1"), "lighthouse='grpc://h:1'"),
    (dict(cross_replica_timeout=0), "cross_replica_timeout=0.0 s must be positive"),
    (dict(in_group_timeout=-5), "in_group_timeout=-5.0 s must be positive"),
    (dict(quorum_timeout=timedelta(0)), "quorum_timeout=0.0 s must be positive"),
    (dict(connect_timeout=-1), "connect_timeout=-1.0 s must be positive"),
    (dict(heartbeat_interval=timedelta(0)), "heartbeat_interval=0.0 s must be positive"),
    (dict(quorum_retries=-1), "quorum_retries=-1"),
    (dict(manager_port=-1), "manager_port=-1"),
    (dict(manager_port=65536), "manager_port=65536"),
    (dict(sync_mode="per_step"), "sync_mode='per_step'"),
    (dict(heal_bind=""), "is not an address peers can dial"),
    (dict(checksum_every=-1), "checksum_every=-1 must be >= 0"),
])
def test_each_validation_rule_names_the_bad_value(kwargs, needle):
    with pytest.raises(ValueError) as err:
        resolve(**kwargs)
    assert needle in str(err.value)


def test_validation_messages_say_how_to_fix():
    with pytest.raises(ValueError, match="torchrun"):
        resolve(group_rank=1, group_size=1)
    with pytest.raises(ValueError, match="lower min_replicas or launch more groups"):
        resolve(min_replicas=2)
    with pytest.raises(ValueError, match="ftbridge-lighthouse serve"):
        resolve(lighthouse="nohost")
    with pytest.raises(ValueError, match="use 0 for a free one"):
        resolve(manager_port=70000)
    with pytest.raises(ValueError, match=re.escape(str(SYNC_MODES))):
        resolve(sync_mode="bogus")


def test_validation_errors_come_from_env_values_too():
    with pytest.raises(ValueError, match="group_rank=3 is outside the replica group of size 2"):
        resolve({"RANK": "3", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="sync_mode='fast'"):
        resolve({"FTBRIDGE_SYNC_MODE": "fast"})


def test_boundary_values_are_accepted():
    cfg = resolve(group_rank=3, group_size=4, min_replicas=2, num_replica_groups=2, manager_port=65535,
                  quorum_retries=0, lighthouse="https://lh.example:443", sync_mode="per_bucket")
    assert cfg.group_rank == 3 and cfg.manager_port == 65535 and cfg.quorum_retries == 0


def test_validate_runs_on_a_directly_built_config():
    # The constructor does not validate; validate() must catch what resolve() would.
    cfg = FTBridgeConfig(replica_group_id=-2)
    with pytest.raises(ValueError, match="replica_group_id=-2"):
        cfg.validate()


# -- timeout hierarchy -------------------------------------------------------

def test_cross_replica_must_be_below_in_group():
    with pytest.raises(ValueError) as err:
        resolve(cross_replica_timeout=60, in_group_timeout=60, quorum_timeout=60)
    msg = str(err.value)
    assert "cross_replica_timeout=60.0 s is not below in_group_timeout=60.0 s" in msg
    assert "lower cross_replica_timeout or raise in_group_timeout" in msg
    resolve(cross_replica_timeout=59.5, in_group_timeout=60, quorum_timeout=60)  # just below: fine


def test_heartbeat_must_be_below_cross_replica():
    with pytest.raises(ValueError) as err:
        resolve(heartbeat_interval=timedelta(seconds=2), cross_replica_timeout=2)
    assert "heartbeat_interval=2.0 s must be below cross_replica_timeout=2.0 s" in str(err.value)
    resolve(heartbeat_interval=timedelta(milliseconds=1999), cross_replica_timeout=2)


def test_cross_replica_may_equal_but_not_exceed_quorum():
    assert resolve(cross_replica_timeout=20, quorum_timeout=20).quorum_timeout == timedelta(seconds=20)
    with pytest.raises(ValueError) as err:
        resolve(cross_replica_timeout=20, quorum_timeout=19)
    assert "quorum_timeout=19.0 s is below cross_replica_timeout=20.0 s" in str(err.value)


def test_hierarchy_checked_for_env_values():
    with pytest.raises(ValueError, match="cross_replica_timeout=61.0 s is not below in_group_timeout=60.0 s"):
        resolve({"FTBRIDGE_CROSS_REPLICA_TIMEOUT_S": "61", "TORCHFT_QUORUM_TIMEOUT_SEC": "100"})
    with pytest.raises(ValueError, match="heartbeat_interval=10.0 s must be below"):
        resolve({"FTBRIDGE_HEARTBEAT_INTERVAL_MS": "10000"})


# -- derived values ----------------------------------------------------------

def test_event_log_path_substitutes_group_and_rank():
    cfg = resolve(event_log="/logs/g{replica_group}/r{group_rank}.jsonl", replica_group_id=2,
                  num_replica_groups=3, group_rank=1, group_size=2)
    assert cfg.event_log_path() == "/logs/g2/r1.jsonl"


def test_event_log_path_from_env_and_without_placeholders():
    env = {"FTBRIDGE_EVENT_LOG": "/l/{replica_group}-{group_rank}.jsonl", "REPLICA_GROUP_ID": "1",
           "NUM_REPLICA_GROUPS": "2", "RANK": "0", "WORLD_SIZE": "1"}
    assert resolve(env).event_log_path() == "/l/1-0.jsonl"
    assert resolve(event_log="/plain.jsonl").event_log_path() == "/plain.jsonl"


def test_event_log_path_none_when_unset_or_empty():
    assert resolve().event_log_path() is None
    assert resolve(event_log="").event_log_path() is None


def test_torchft_environ_mirrors_the_resolved_values():
    cfg = resolve(cross_replica_timeout=7, quorum_timeout=45, connect_timeout=timedelta(seconds=3),
                  quorum_retries=2)
    assert cfg.torchft_environ() == {
        "TORCHFT_TIMEOUT_SEC": "14",  # torchft's own calls: twice the cross-replica timeout
        "TORCHFT_QUORUM_TIMEOUT_SEC": "45",
        "TORCHFT_CONNECT_TIMEOUT_SEC": "3",
        "TORCHFT_QUORUM_RETRIES": "2",
    }


def test_torchft_environ_rounds_up_to_whole_seconds_at_least_one():
    cfg = resolve(cross_replica_timeout=0.5, quorum_timeout=2.9, connect_timeout=0.2,
                  heartbeat_interval=0.1)
    env = cfg.torchft_environ()
    assert env["TORCHFT_TIMEOUT_SEC"] == "1"  # 2 x 0.5 s; never 0: torchft would treat it as no time at all
    assert env["TORCHFT_QUORUM_TIMEOUT_SEC"] == "3"  # rounded up: torchft never waits less than configured
    assert env["TORCHFT_CONNECT_TIMEOUT_SEC"] == "1"
    assert all(isinstance(v, str) for v in env.values())


def test_torchft_environ_round_trips_through_resolve():
    cfg = resolve(cross_replica_timeout=8, quorum_timeout=40, connect_timeout=4, quorum_retries=1)
    again = resolve(cfg.torchft_environ())
    assert again.quorum_timeout == cfg.quorum_timeout
    assert again.connect_timeout == cfg.connect_timeout
    assert again.quorum_retries == cfg.quorum_retries


def test_torchft_timeout_env_is_not_read_as_the_cross_replica_timeout():
    # ftbridge exports TORCHFT_TIMEOUT_SEC = 2 x cross_replica_timeout for torchft's Manager (whose
    # environment overrides its arguments); reading it back would double the timeout on every resolve.
    cfg = resolve(cross_replica_timeout=5)
    assert cfg.torchft_timeout == timedelta(seconds=10)
    assert resolve(cfg.torchft_environ()).cross_replica_timeout == timedelta(seconds=10)  # the default


def test_event_log_with_unknown_placeholder_is_refused_at_validation():
    try:
        resolve(event_log="/logs/{rank}.jsonl")
    except ValueError as e:
        assert "{rank}" in str(e)
        return
    raise AssertionError("resolve accepted an event_log with an unknown placeholder")


@pytest.mark.parametrize("address", ["http://host:", "http://[::1]"])
def test_lighthouse_without_port_is_refused(address):
    with pytest.raises(ValueError, match="lighthouse="):
        resolve(lighthouse=address)


def test_derived_timeouts_are_named_and_ordered():
    cfg = resolve(cross_replica_timeout=8)
    assert (cfg.vote_timeout, cfg.store_call_timeout, cfg.torchft_timeout, cfg.sigterm_grace) == (
        timedelta(seconds=2), timedelta(seconds=4), timedelta(seconds=16), timedelta(seconds=16))
    # The vote and its store calls end before the cross-replica timeout that bounds the other ranks'
    # should_commit meanwhile; torchft's own calls outlast a cross-replica all-reduce with a hung peer.
    assert cfg.vote_timeout < cfg.store_call_timeout < cfg.cross_replica_timeout < cfg.torchft_timeout


def test_overrides_are_checked_against_each_settings_kind():
    # Strings as the environment takes them (a DeepSpeed config written by hand, a CLI value).
    cfg = FTBridgeConfig.resolve({}, num_replica_groups="2", min_replicas="2", peer_watch="no",
                                 ride_out_lighthouse_outage=0)
    assert (cfg.min_replicas, cfg.peer_watch, cfg.ride_out_lighthouse_outage) == (2, False, False)
    for bad, needle in ((dict(min_replicas=2.5), "min_replicas=2.5 is not an integer"),
                        (dict(min_replicas=True), "min_replicas=True is not an integer"),
                        (dict(min_replicas="two"), "min_replicas='two' is not an integer"),
                        (dict(peer_watch="maybe"), "peer_watch='maybe' is not a boolean"),
                        (dict(peer_watch=2), "peer_watch=2 is not a boolean")):
        with pytest.raises(ValueError, match=re.escape(needle)):
            FTBridgeConfig.resolve({}, **bad)


@pytest.mark.parametrize("given", [{"init_sync": True}, {"environ": {"FTBRIDGE_INIT_SYNC": "1"}}])
def test_init_sync_is_refused_with_the_fix(given):
    environ = given.pop("environ", {})
    with pytest.raises(ValueError, match=r"init_sync=True \(FTBRIDGE_INIT_SYNC\) is not supported.*one seed"):
        resolve(environ, **given)
