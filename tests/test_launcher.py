"""Unit tests of ftbridge/launch/run.py: torchrun's command line, environment and argument checks.

Nothing here starts torchrun: ``subprocess.Popen`` in the launcher fails the
test if it is called.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ftbridge.launch import run as launcher

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("print('hello')\n")
    return str(path)


@pytest.fixture
def no_launch(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"the launcher started a process: {args}")

    monkeypatch.setattr(subprocess, "Popen", refuse)  # the one module object: supervise.py starts torchrun


@pytest.fixture
def clean_env(monkeypatch):
    """Remove the variables the launcher reads, so the host's environment cannot leak in."""
    for name in list(os.environ):
        if name.startswith(("FTBRIDGE_", "TORCHFT_")) or name in (
                "REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "OMP_NUM_THREADS", "RANK", "WORLD_SIZE"):
            monkeypatch.delenv(name)


def build(argv, environ=None, port=40123):
    args = launcher.parse_args(argv)
    picked = []

    def pick_port():
        picked.append(port)
        return port

    argv_out, env = launcher.build_torchrun_command(args, environ if environ is not None else {},
                                                    pick_port=pick_port, launch_id="tag123")
    return argv_out, env, picked


GROUP = ["--replica-group-id", "1", "--num-replica-groups", "2", "--nproc-per-node", "2"]


def test_default_command_is_c10d_with_own_rendezvous_per_group(script):
    argv, env, picked = build([*GROUP, "--", script, "--steps", "5"])
    assert argv == [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "1", "--nproc-per-node", "2", "--node-rank", "0",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:40123", "--rdzv-id", "ftbridge-group-1",
        "--max-restarts", "3",
        script, "--steps", "5",
    ]
    assert picked == [40123]
    assert env == {
        "REPLICA_GROUP_ID": "1", "FTBRIDGE_REPLICA_GROUP_ID": "1", "FTBRIDGE_SPARE_INDEX": "-1",
        "NUM_REPLICA_GROUPS": "2", "FTBRIDGE_NUM_REPLICA_GROUPS": "2",
        "TORCHFT_LIGHTHOUSE": "http://127.0.0.1:29510", "FTBRIDGE_LIGHTHOUSE": "http://127.0.0.1:29510",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "10",
        "OMP_NUM_THREADS": "1",
        "RUST_LOG": "warn",
        "FTBRIDGE_LAUNCH_ID": "tag123",
    }


def test_optional_settings_become_ftbridge_variables(script):
    argv, env, _ = build([*GROUP, "--lighthouse", "http://10.0.0.5:29510", "--max-restarts", "0",
                          "--min-replicas", "2", "--cross-replica-timeout-s", "5",
                          "--quorum-timeout-s", "20.5", "--heartbeat-interval-ms", "200",
                          "--event-log", "/tmp/ev-{replica_group}-{group_rank}.jsonl",
                          "--shutdown-timeout-s", "2.5", "--", script])
    assert argv[argv.index("--max-restarts") + 1] == "0"
    assert env["TORCHFT_LIGHTHOUSE"] == env["FTBRIDGE_LIGHTHOUSE"] == "http://10.0.0.5:29510"
    assert env["FTBRIDGE_MIN_REPLICAS"] == "2"
    assert env["FTBRIDGE_CROSS_REPLICA_TIMEOUT_S"] == "5"
    assert env["FTBRIDGE_QUORUM_TIMEOUT_S"] == "20.5"
    assert env["FTBRIDGE_HEARTBEAT_INTERVAL_MS"] == "200"
    assert env["FTBRIDGE_EVENT_LOG"] == "/tmp/ev-{replica_group}-{group_rank}.jsonl"
    assert env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "3"


def test_flags_not_given_set_no_variables(script):
    _, env, _ = build([*GROUP, "--", script])
    assert not {"FTBRIDGE_MIN_REPLICAS", "FTBRIDGE_CROSS_REPLICA_TIMEOUT_S", "FTBRIDGE_QUORUM_TIMEOUT_S",
                "FTBRIDGE_HEARTBEAT_INTERVAL_MS", "FTBRIDGE_EVENT_LOG"} & set(env)


def test_environment_is_passed_on_and_flags_win_over_stale_values(script):
    inherited = {"PATH": "/bin", "OMP_NUM_THREADS": "4", "FTBRIDGE_REPLICA_GROUP_ID": "0",
                 "REPLICA_GROUP_ID": "0", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"}
    _, env, _ = build([*GROUP, "--", script], environ=inherited)
    assert env["PATH"] == "/bin"
    assert env["OMP_NUM_THREADS"] == "4"  # the user's choice is kept
    assert env["FTBRIDGE_REPLICA_GROUP_ID"] == env["REPLICA_GROUP_ID"] == "1"
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"  # restarts need it


@pytest.mark.parametrize("environ, expected", [
    ({"TORCHFT_LIGHTHOUSE": "http://lh:1234"}, "http://lh:1234"),
    ({"TORCHFT_LIGHTHOUSE": "http://lh:1234", "FTBRIDGE_LIGHTHOUSE": "http://ft:99"}, "http://ft:99"),
    ({}, "http://127.0.0.1:29510"),
])
def test_lighthouse_defaults_from_environment(script, environ, expected):
    _, env, _ = build([*GROUP, "--", script], environ=environ)
    assert env["TORCHFT_LIGHTHOUSE"] == expected
    _, env, _ = build([*GROUP, "--lighthouse", "http://flag:7", "--", script], environ=environ)
    assert env["TORCHFT_LIGHTHOUSE"] == "http://flag:7"


def test_given_rendezvous_endpoint_is_used_for_multi_node_groups(script):
    argv, _, picked = build([*GROUP, "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "node3:29400",
                             "--rdzv-id", "job7-g1", "--", script])
    assert picked == []
    assert argv[argv.index("--nnodes") + 1] == "2"
    assert argv[argv.index("--node-rank") + 1] == "1"
    assert argv[argv.index("--rdzv-endpoint") + 1] == "node3:29400"
    assert argv[argv.index("--rdzv-id") + 1] == "job7-g1"


def test_master_addr_is_the_default_endpoint_host(script):
    argv, _, _ = build([*GROUP, "--master-addr", "10.1.2.3", "--", script])
    assert argv[argv.index("--rdzv-endpoint") + 1] == "10.1.2.3:40123"


def test_non_c10d_backend_warns(script, caplog):
    with caplog.at_level("WARNING", logger="ftbridge.launch.run"):
        build([*GROUP, "--rdzv-backend", "static", "--", script])
    assert "--rdzv-backend=static" in caplog.text and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" in caplog.text


BAD = [
    (["--replica-group-id", "-1", "--num-replica-groups", "2", "--nproc-per-node", "1"], "--replica-group-id=-1"),
    (["--replica-group-id", "2", "--num-replica-groups", "2", "--nproc-per-node", "1"], "--replica-group-id=2"),
    (["--replica-group-id", "0", "--num-replica-groups", "0", "--nproc-per-node", "1"], "--num-replica-groups=0"),
    (["--replica-group-id", "0", "--num-replica-groups", "1", "--nproc-per-node", "0"], "--nproc-per-node=0"),
    ([*GROUP, "--max-restarts", "-1"], "--max-restarts=-1"),
    ([*GROUP, "--shutdown-timeout-s", "0"], "--shutdown-timeout-s=0"),
    ([*GROUP, "--lighthouse", "localhost:29510"], "--lighthouse='localhost:29510'"),
    ([*GROUP, "--lighthouse", "http://lh"], "--lighthouse='http://lh'"),
    ([*GROUP, "--lighthouse", "http://lh:99999"], "--lighthouse='http://lh:99999'"),
    ([*GROUP, "--lighthouse", "ftp://lh:21"], "--lighthouse='ftp://lh:21'"),
    ([*GROUP, "--min-replicas", "3"], "min_replicas=3 exceeds num_replica_groups=2"),
    ([*GROUP, "--min-replicas", "0"], "min_replicas=0"),
    ([*GROUP, "--cross-replica-timeout-s", "0"], "cross_replica_timeout=0.0 s"),
    ([*GROUP, "--quorum-timeout-s", "1"], "quorum_timeout=1.0 s is below"),
    ([*GROUP, "--heartbeat-interval-ms", "20000"], "heartbeat_interval=20.0 s"),
    ([*GROUP, "--nnodes", "x"], "--nnodes='x'"),
    ([*GROUP, "--nnodes", "2:1"], "--nnodes='2:1'"),
    ([*GROUP, "--nnodes", "2"], "--nnodes=2 needs --rdzv-endpoint"),
    ([*GROUP, "--node-rank", "-1"], "--node-rank=-1"),
    ([*GROUP, "--shutdown-timeout-s", "inf"], "--shutdown-timeout-s=inf"),
    ([*GROUP, "--shutdown-timeout-s", "nan"], "--shutdown-timeout-s=nan"),
    ([*GROUP, "--heartbeat-interval-ms", "inf"], "--heartbeat-interval-ms=inf"),
    ([*GROUP, "--cross-replica-timeout-s", "inf"], "cross_replica_timeout=inf"),
    ([*GROUP, "--rdzv-endpoint", ":29400"], "--rdzv-endpoint=':29400'"),
    ([*GROUP, "--rdzv-endpoint", "host:port"], "--rdzv-endpoint='host:port'"),
    ([*GROUP, "--event-log", "/tmp/{rank}.jsonl"], "--event-log='/tmp/{rank}.jsonl'"),
    ([*GROUP, "--spare", "0"], "give exactly one of --replica-group-id I"),
    (["--num-replica-groups", "2", "--nproc-per-node", "1"], "give exactly one of --replica-group-id I"),
    (["--spare", "-1", "--num-replica-groups", "2", "--nproc-per-node", "1"], "--spare-index=-1 is negative"),
]


def test_spare_gets_its_index_an_out_of_range_group_id_and_its_own_rendezvous(script):
    argv, env, _ = build(["--spare-index", "1", "--num-replica-groups", "2", "--nproc-per-node", "2", "--", script])
    assert env["FTBRIDGE_SPARE_INDEX"] == "1"
    # N + K until it takes over a group: a data shard read before initialize returns would be out of range
    assert env["REPLICA_GROUP_ID"] == env["FTBRIDGE_REPLICA_GROUP_ID"] == "3"
    assert argv[argv.index("--rdzv-id") + 1] == "ftbridge-spare-1"


@pytest.mark.parametrize("flags, named", BAD, ids=[b[1] for b in BAD])
def test_bad_value_exits_2_naming_it(flags, named, script, no_launch, clean_env, capsys):
    assert launcher.main([*flags, "--", script]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ftbridge-run: error: ")
    assert named in err


def test_missing_script_file_exits_2(no_launch, clean_env, capsys, tmp_path):
    missing = str(tmp_path / "nope.py")
    assert launcher.main([*GROUP, "--", missing]) == 2
    assert f"script {missing!r}" in capsys.readouterr().err


@pytest.mark.parametrize("tail", [[], ["--"]], ids=["no-dashdash", "nothing-after-dashdash"])
def test_missing_script_exits_2(tail, no_launch, clean_env, capsys):
    assert launcher.main([*GROUP, *tail]) == 2
    assert "missing '-- SCRIPT [ARGS...]'" in capsys.readouterr().err


@pytest.mark.parametrize("flags, named", [
    (["--num-replica-groups", "2", "--nproc-per-node", "1"], "--replica-group-id"),
    (["--replica-group-id", "0", "--num-replica-groups", "2", "--nproc-per-node", "two"], "--nproc-per-node"),
    ([*GROUP, "--no-such-flag"], "--no-such-flag"),
])
def test_argparse_errors_exit_2(flags, named, script, no_launch, clean_env, capsys):
    assert launcher.main([*flags, "--", script]) == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize("name, value, named", [
    ("TORCHFT_LIGHTHOUSE", "lighthouse:29510", "TORCHFT_LIGHTHOUSE='lighthouse:29510'"),
    ("FTBRIDGE_CROSS_REPLICA_TIMEOUT_S", "soon", "FTBRIDGE_CROSS_REPLICA_TIMEOUT_S='soon'"),
    ("FTBRIDGE_IN_GROUP_TIMEOUT_S", "5", "in_group_timeout=5.0 s"),
    ("FTBRIDGE_LOG_LEVEL", "verbose", "FTBRIDGE_LOG_LEVEL='verbose' is not a log level"),
])
def test_bad_inherited_environment_exits_2(name, value, named, script, no_launch, clean_env,
                                           monkeypatch, capsys):
    monkeypatch.setenv(name, value)
    assert launcher.main([*GROUP, "--", script]) == 2
    assert named in capsys.readouterr().err


def test_help_exits_0(capsys, no_launch):
    assert launcher.main(["--help"]) == 0
    assert "--replica-group-id" in capsys.readouterr().out


@pytest.mark.timeout(60)
def test_wrapper_script_and_module_show_usage():
    for cmd in ([sys.executable, "scripts/ftbridge_run.py", "--help"],
                [sys.executable, "-m", "ftbridge.launch.run", "--help"]):
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=50, check=False)
        assert done.returncode == 0, done.stderr
        assert "usage: ftbridge-run" in done.stdout


def test_unreachable_lighthouse_is_refused_before_launch(script, capsys):
    port = launcher.find_free_port()  # nothing listens there
    code = launcher.main(["--replica-group-id", "0", "--num-replica-groups", "1", "--nproc-per-node", "1",
                          "--lighthouse", f"http://127.0.0.1:{port}", "--", script])
    assert code == 2
    err = capsys.readouterr().err
    assert f"no lighthouse answers at http://127.0.0.1:{port}" in err and "ftbridge-lighthouse serve" in err


def test_a_log_level_in_any_case_is_taken():
    from ftbridge.log import log_level

    assert log_level("debug") == "DEBUG" and log_level(" Warning ") == "WARNING"
    assert log_level(None, group_rank=0) == "INFO" and log_level("", group_rank=1) == "WARNING"
