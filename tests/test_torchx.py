"""The TorchX component: its AppDef, and the Slurm and Kubernetes requests TorchX builds from it (dry runs only)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torchx.specs as specs
from torchx.schedulers.kubernetes_scheduler import KubernetesScheduler
from torchx.schedulers.slurm_scheduler import SlurmScheduler

from ftbridge.launch.torchx import job
from ftbridge.manager.lighthouse_status import Heartbeat, LighthouseStatus
from lighthouse.cli import IdleTimer

ARGS = ("--steps", "1000", "--zero-stage", "2")


def _cluster_app(**kw):
    return job(*ARGS, script="train.py", groups=2, nnodes=2, gpus=8, image="registry/ftbridge:1",
               metrics_port=9400, **kw)


def test_appdef_roles_ports_env_and_restart_policy():
    app = _cluster_app()
    assert [r.name for r in app.roles] == ["lighthouse", "group0", "group1"]
    lh, *groups = app.roles
    assert lh.num_replicas == 1 and lh.entrypoint == "ftbridge-lighthouse"
    assert lh.port_map == {"lighthouse": 29510, "health": 29511, "status": 29512}
    assert "--exit-when-idle-s" in lh.args
    for g, role in enumerate(groups):
        assert role.num_replicas == role.min_replicas == 2
        assert role.max_retries == 3 and role.retry_policy == specs.RetryPolicy.REPLICA
        assert role.env["REPLICA_GROUP_ID"] == str(g) and role.env["NUM_REPLICA_GROUPS"] == "2"
        assert role.env["FTBRIDGE_METRICS_PORT"] == "9400"
        assert role.port_map == {"rdzv": 29400, "metrics": 9400}
        assert role.resource.gpu == 8
        cmd = role.args[1]
        assert f"--replica-group-id {g} --num-replica-groups 2 --nproc-per-node 8 --max-restarts 3" in cmd
        assert f"--rdzv-id ftbridge-group-{g}" in cmd and cmd.endswith("-- train.py --steps 1000 --zero-stage 2")
    # An external lighthouse: no lighthouse role, groups dial it.
    ext = job(script="t.py", groups=3, lighthouse="http://10.0.0.5:29510")
    assert [r.name for r in ext.roles] == ["group0", "group1", "group2"]
    assert '--lighthouse "http://10.0.0.5:29510"' in ext.roles[0].args[1]
    assert "--nnodes" not in ext.roles[0].args[1] and ext.roles[0].port_map == {}  # one node: local rendezvous


@pytest.mark.parametrize("kw, match", [
    (dict(groups=0), "groups=0"), (dict(nnodes=0), "nnodes=0"), (dict(min_replicas=3), "min_replicas=3"),
    (dict(lighthouse_port=0), "lighthouse_port=0"), (dict(lighthouse="10.0.0.5:29510"), "http://HOST:PORT"),
    (dict(metrics_port=-2), "metrics_port=-2"), (dict(max_restarts=-1), "max_restarts=-1"),
    (dict(lighthouse_min_replicas=3), "lighthouse_min_replicas=3"),
    (dict(lighthouse_heartbeat_timeout_ms=0), "lighthouse_heartbeat_timeout_ms=0"),
    (dict(heal_bind="10.0.0.1 10.0.0.2"), "heal_bind="),
    # Settings the ranks resolve: refused when the job is described, not after it was scheduled.
    (dict(env={"FTBRIDGE_PEER_WATCH": "maybe"}), "FTBRIDGE_PEER_WATCH='maybe' is not a valid bool"),
    (dict(env={"FTBRIDGE_CROSS_REPLICA_TIMEOUT_S": "abc"}), "FTBRIDGE_CROSS_REPLICA_TIMEOUT_S='abc'"),
    (dict(env={"FTBRIDGE_LOG_LEVEL": "chatty"}), "FTBRIDGE_LOG_LEVEL"),
])
def test_bad_job_description_is_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        job(script="t.py", **kw)


def test_slurm_dry_run_sbatch_script():
    script = SlurmScheduler("test").submit_dryrun(_cluster_app(), {}).request.materialize()
    # One heterogeneous job: the lighthouse, then one component per node of each group.
    names = re.findall(r"^#SBATCH --job-name=(\S+)", script, re.M)
    assert names == ["lighthouse-0", "group0-0", "group0-1", "group1-0", "group1-1"]
    assert script.count("#SBATCH hetjob") == 4
    assert script.count("--gpus-per-task=8") == 4 and script.count("--requeue") == 5
    assert "export TORCHX_MAX_RETRIES=3" in script and 'scontrol requeue "$SLURM_JOB_ID"' in script
    # TorchX 0.7 ends every component when one exits with an error (docs/multi-node.md says so).
    assert script.count("--kill-on-bad-exit=1") == 5
    assert "ftbridge-lighthouse serve --bind 0.0.0.0:29510 --health-bind 0.0.0.0:29511" in script
    assert script.count('--lighthouse "http://${SLURM_JOB_NODELIST_HET_GROUP_0:=localhost}:29510"') == 4
    # Each group's rendezvous is on its own first node: het groups 1 (group 0) and 3 (group 1).
    assert script.count("${SLURM_JOB_NODELIST_HET_GROUP_1:-localhost}}:29400") == 2
    assert script.count("${SLURM_JOB_NODELIST_HET_GROUP_3:-localhost}}:29400") == 2
    assert script.count("--export=ALL,REPLICA_GROUP_ID=1,NUM_REPLICA_GROUPS=2,FTBRIDGE_MIN_REPLICAS=1,"
                        "FTBRIDGE_METRICS_PORT=9400") == 2
    assert "export FTBRIDGE_HEAL_BIND=${ip:-127.0.0.1}" in script


def test_kubernetes_dry_run_volcano_job():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchX warns that Volcano retries are unreliable
        req = KubernetesScheduler("test").submit_dryrun(_cluster_app(), {"queue": "default"}).request
    spec = req.resource["spec"]
    assert req.resource["kind"] == "Job" and spec["schedulerName"] == "volcano"
    tasks = {t["name"]: t for t in spec["tasks"]}
    assert list(tasks) == ["lighthouse-0", "group0-0", "group0-1", "group1-0", "group1-1"]
    for name, task in tasks.items():
        assert task["replicas"] == 1 and task["maxRetry"] == 3 and task["policies"] == []  # retry this task only
        pod = task["template"].spec
        assert pod.restart_policy == "Never"
        container = pod.containers[0]
        ports = {p.name: p.container_port for p in container.ports}
        env = {e.name: e.value for e in container.env}
        if name == "lighthouse-0":
            assert ports == {"lighthouse": 29510, "health": 29511, "status": 29512}
            assert container.command[:2] == ["ftbridge-lighthouse", "serve"]
            continue
        g = name[len("group")]
        assert ports == {"rdzv": 29400, "metrics": 9400}
        assert env["REPLICA_GROUP_ID"] == g and env["FTBRIDGE_METRICS_PORT"] == "9400"
        assert container.resources.limits["nvidia.com/gpu"] == "8"
        cmd = container.command[2]
        assert '--lighthouse "http://${VC_LIGHTHOUSE_0_HOSTS:=localhost}:29510"' in cmd
        assert f"${{VC_GROUP{g}_0_HOSTS:-" in cmd
        assert container.image == "registry/ftbridge:1"
    assert spec["plugins"]["svc"] == ["--publish-not-ready-addresses"]  # pod host names for the variables above


def test_component_is_registered_for_torchx(monkeypatch):
    """``ftbridge.job`` resolves through the ``torchx.components`` entry point, beside TorchX's builtins."""
    import torchx.components as builtins
    from torchx.specs import finder

    import ftbridge.launch.torchx as component

    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert '[project.entry-points."torchx.components"]' in text
    assert 'ftbridge = "ftbridge.launch.torchx"' in text and '_0 = "torchx.components"' in text
    monkeypatch.setattr(finder.entrypoints, "load_group",
                        lambda group, default=None: {"ftbridge": lambda: component, "_0": lambda: builtins})
    monkeypatch.setattr(finder, "_components", None)
    assert finder.get_component("ftbridge.job").fn is component.job
    assert finder.get_component("dist.ddp")  # TorchX's own components stay available


def _status(quorum, fresh):
    beats = [Heartbeat("replica_group_0:a", 0.1 if fresh else 9.0, not fresh)]
    return LighthouseStatus(quorum_id=quorum or 0, next_quorum="", previous_quorum_id=quorum, heartbeats=beats)


def test_lighthouse_exits_only_after_the_job_ran_and_every_group_went_quiet():
    timer = IdleTimer(10)
    assert not timer.expired(None, 0)
    assert not timer.expired(_status(None, False), 100)  # no quorum yet: the job has not started
    assert not timer.expired(_status(3, False), 200)      # quiet since 200
    assert not timer.expired(_status(3, True), 205)       # a group came back (a restart): start again
    assert not timer.expired(_status(3, False), 206)
    assert not timer.expired(_status(3, False), 215)
    assert timer.expired(_status(3, False), 216)
    assert not IdleTimer(0).expired(_status(3, False), 1e9)
