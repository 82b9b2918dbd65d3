"""TorchX component: a whole ftbridge job (lighthouse + replica groups) as one ``AppDef``.

:func:`job` (``torchx run -s SCHEDULER ftbridge.job --groups 2 --script train.py``) builds role ``lighthouse``,
then ``group0`` .. ``group{N-1}``, each ``nnodes`` replicas of ``ftbridge-run`` under ``bash -c``, retried alone.
Roles, addresses and each scheduler's failure handling: docs/multi-node.md.
"""


import shlex
from typing import Dict, List, Optional

import torchx.specs as specs

LIGHTHOUSE_ROLE = "lighthouse"
DEFAULT_LIGHTHOUSE_PORT = 29510
DEFAULT_RDZV_PORT = 29400
_AUTO_IP = "$(hostname -I 2>/dev/null | awk '{print $1}')"


def job(
    *script_args: str,
    script: str,
    groups: int = 2,
    nnodes: int = 1,
    nproc_per_node: int = 0,
    gpus: int = 0,
    cpu: int = 4,
    memMB: int = 16384,
    h: Optional[str] = None,
    image: str = "",
    name: str = "ftbridge",
    lighthouse: str = "",
    lighthouse_port: int = DEFAULT_LIGHTHOUSE_PORT,
    lighthouse_min_replicas: int = 1,
    lighthouse_heartbeat_timeout_ms: int = 3000,
    lighthouse_idle_exit_s: int = 300,
    min_replicas: int = 1,
    max_restarts: int = 3,
    max_retries: int = 3,
    rdzv_port: int = DEFAULT_RDZV_PORT,
    heal_bind: str = "auto",
    metrics_port: int = -1,
    event_log: str = "",
    env: Optional[Dict[str, str]] = None,
) -> specs.AppDef:
    """A fault-tolerant DeepSpeed job: a lighthouse and one role per replica group.

    Args:
        script_args: arguments of the training script.
        script: the training script (path inside the image or workspace).
        groups: number of replica groups (>= 1).
        nnodes: nodes per replica group (one role replica per node).
        nproc_per_node: ranks per node; 0: ``gpus``, or 1 without GPUs.
        gpus: GPUs per node of a group.
        cpu: CPUs per node of a group.
        memMB: memory per node of a group, MB.
        h: a TorchX named resource for the group nodes (overrides cpu/gpus/memMB).
        image: container image (Kubernetes) or image root (local_cwd: empty for the current directory).
        name: application name.
        lighthouse: address of a lighthouse that already runs (http://HOST:PORT); empty: the job runs its own.
        lighthouse_port: port of the job's own lighthouse (health on +1, status page and /metrics on +2).
        lighthouse_min_replicas: the lighthouse's --min-replicas.
        lighthouse_heartbeat_timeout_ms: silence after which the lighthouse counts a group as dead, ms.
        lighthouse_idle_exit_s: the job's own lighthouse exits 0 this many seconds after the last group's
            heartbeat (0: never; the application then ends only when cancelled).
        min_replicas: fewest replica groups that may commit a step (FTBRIDGE_MIN_REPLICAS).
        max_restarts: torchrun restarts of a group in place (ftbridge-run --max-restarts).
        max_retries: scheduler restarts of a failed role replica (its pod or task), that replica only.
        rdzv_port: port of a multi-node group's rendezvous on its first node.
        heal_bind: the address peers dial on each node (FTBRIDGE_HEAL_BIND); auto: the node's first address
            from ``hostname -I``.
        metrics_port: Prometheus /metrics port of each group's rank 0 (FTBRIDGE_METRICS_PORT); 0: a free
            port; -1: off.
        event_log: JSON-lines event log path per rank (FTBRIDGE_EVENT_LOG; {replica_group}, {group_rank}).
        env: more environment for every group (e.g. FTBRIDGE_* settings, NCCL_SOCKET_IFNAME).

    Returns:
        The ``AppDef``: role ``lighthouse`` (unless ``lighthouse`` is given), then ``group0`` ... ``group{N-1}``.

    Raises:
        ValueError: a bad count, port or setting, naming the value and the fix.
    """
    _validate(groups=groups, nnodes=nnodes, nproc_per_node=nproc_per_node, gpus=gpus, min_replicas=min_replicas,
              max_restarts=max_restarts, max_retries=max_retries, lighthouse=lighthouse,
              ports={"lighthouse_port": lighthouse_port, "rdzv_port": rdzv_port}, metrics_port=metrics_port,
              lighthouse_idle_exit_s=lighthouse_idle_exit_s, lighthouse_min_replicas=lighthouse_min_replicas,
              lighthouse_heartbeat_timeout_ms=lighthouse_heartbeat_timeout_ms, heal_bind=heal_bind)
    nproc = nproc_per_node or gpus or 1
    _check_settings(env or {}, groups=groups, nproc=nproc, min_replicas=min_replicas)
    roles: List[specs.Role] = []
    if not lighthouse:
        roles.append(_lighthouse_role(image, lighthouse_port, lighthouse_min_replicas,
                                      lighthouse_heartbeat_timeout_ms, lighthouse_idle_exit_s, max_retries))
        lighthouse = f"http://$${{{specs.macros.rank0_env}:=localhost}}:{lighthouse_port}"
    first_het_group = 1 if roles else 0
    base_env = {"FTBRIDGE_MIN_REPLICAS": str(min_replicas), **(env or {})}
    if metrics_port >= 0:
        base_env["FTBRIDGE_METRICS_PORT"] = str(metrics_port)
    if event_log:
        base_env["FTBRIDGE_EVENT_LOG"] = event_log
    resource = specs.resource(cpu=cpu, gpu=gpus, memMB=memMB, h=h)
    for g in range(groups):
        cmd = _group_command(g, groups, nnodes, nproc, lighthouse, max_restarts, rdzv_port,
                             slurm_het_group=first_het_group + g * nnodes, heal_bind=heal_bind,
                             script=script, script_args=script_args)
        ports = {"rdzv": rdzv_port} if nnodes > 1 else {}
        if metrics_port > 0:
            ports["metrics"] = metrics_port
        roles.append(specs.Role(
            name=f"group{g}", image=image, entrypoint="bash", args=["-c", cmd], num_replicas=nnodes,
            min_replicas=nnodes, resource=resource, port_map=ports,
            env={"REPLICA_GROUP_ID": str(g), "NUM_REPLICA_GROUPS": str(groups), **base_env},
            max_retries=max_retries, retry_policy=specs.RetryPolicy.REPLICA))
    return specs.AppDef(name=name, roles=roles)


def _lighthouse_role(image: str, port: int, min_replicas: int, heartbeat_timeout_ms: int, idle_exit_s: int,
                     max_retries: int) -> specs.Role:
    args = ["serve", "--bind", f"0.0.0.0:{port}", "--health-bind", f"0.0.0.0:{port + 1}",
            "--status-bind", f"0.0.0.0:{port + 2}", "--min-replicas", str(min_replicas),
            "--heartbeat-timeout-ms", str(heartbeat_timeout_ms)]
    if idle_exit_s:
        args += ["--exit-when-idle-s", str(idle_exit_s)]
    return specs.Role(
        name=LIGHTHOUSE_ROLE, image=image, entrypoint="ftbridge-lighthouse", args=args, num_replicas=1,
        resource=specs.resource(cpu=2, gpu=0, memMB=2048),
        port_map={"lighthouse": port, "health": port + 1, "status": port + 2},
        env={"RUST_LOG": "warn"}, max_retries=max_retries, retry_policy=specs.RetryPolicy.REPLICA)


def _group_command(g: int, groups: int, nnodes: int, nproc: int, lighthouse: str, max_restarts: int,
                   rdzv_port: int, *, slurm_het_group: int, heal_bind: str, script: str,
                   script_args: tuple) -> str:
    """The ``bash -c`` text of one node of replica group ``g``: set the node's address, exec ftbridge-run.

    Literal ``$`` is written ``$$`` (TorchX's ``string.Template`` macros); ``lighthouse`` comes in that form.
    """
    bind = f'"${{FTBRIDGE_HEAL_BIND:-{_AUTO_IP}}}"' if heal_bind == "auto" else shlex.quote(heal_bind)
    lines = [f"ip={bind}; export FTBRIDGE_HEAL_BIND=${{ip:-127.0.0.1}}"]
    run = ["exec", "ftbridge-run", "--replica-group-id", str(g), "--num-replica-groups", str(groups),
           "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts), "--no-lighthouse-check"]
    quoted = [shlex.quote(a) for a in run]
    if nnodes > 1:
        lines.append("export PET_LOCAL_ADDR=$FTBRIDGE_HEAL_BIND")
        # The group's first node: Volcano's task host variable, else Slurm's heterogeneous group, else local.
        first = f"${{VC_GROUP{g}_0_HOSTS:-${{SLURM_JOB_NODELIST_HET_GROUP_{slurm_het_group}:-localhost}}}}"
        quoted += ["--nnodes", str(nnodes), "--rdzv-endpoint", f'"{first}:{rdzv_port}"',
                   "--rdzv-id", shlex.quote(f"ftbridge-group-{g}")]
    tail = ["--", shlex.quote(script), *(shlex.quote(a) for a in script_args)]
    text = "; ".join(lines) + "; " + " ".join(quoted)
    # Double quotes around the lighthouse let bash expand its host variable.
    return f'{_escape(text)} --lighthouse "{lighthouse}" {_escape(" ".join(tail))}'


def _escape(text: str) -> str:
    """``text`` with every ``$`` doubled, so TorchX's macro substitution gives it back unchanged."""
    return text.replace("$", "$$")


def _validate(*, groups: int, nnodes: int, nproc_per_node: int, gpus: int, min_replicas: int, max_restarts: int,
              max_retries: int, lighthouse: str, ports: Dict[str, int], metrics_port: int,
              lighthouse_idle_exit_s: int, lighthouse_min_replicas: int, lighthouse_heartbeat_timeout_ms: int,
              heal_bind: str) -> None:
    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ValueError(msg)

    need(groups >= 1, f"groups={groups}: give at least 1 replica group (2 or more to survive a failure)")
    need(nnodes >= 1, f"nnodes={nnodes}: a replica group needs at least 1 node")
    need(nproc_per_node >= 0 and gpus >= 0, f"nproc_per_node={nproc_per_node}, gpus={gpus}: must be >= 0")
    need(1 <= min_replicas <= groups, f"min_replicas={min_replicas} must be between 1 and groups={groups}")
    need(max_restarts >= 0 and max_retries >= 0,
         f"max_restarts={max_restarts}, max_retries={max_retries}: must be >= 0")
    need(lighthouse_idle_exit_s >= 0, f"lighthouse_idle_exit_s={lighthouse_idle_exit_s}: must be >= 0 (0: never)")
    need(1 <= lighthouse_min_replicas <= groups,
         f"lighthouse_min_replicas={lighthouse_min_replicas} must be between 1 and groups={groups}")
    need(lighthouse_heartbeat_timeout_ms > 0,
         f"lighthouse_heartbeat_timeout_ms={lighthouse_heartbeat_timeout_ms}: must be a positive number of ms")
    need(bool(heal_bind.strip()) and not any(c.isspace() for c in heal_bind),
         f"heal_bind={heal_bind!r}: give auto or one address (the node's address its peers dial)")
    for key, port in ports.items():
        need(0 < port < 65534, f"{key}={port} is not a fixed port; give one in 1-65533")
    need(-1 <= metrics_port < 65536, f"metrics_port={metrics_port}: -1 (off), 0 (free port) or a port")
    need(not lighthouse or lighthouse.startswith(("http://", "https://")),
         f"lighthouse={lighthouse!r} is not an address like http://HOST:PORT; leave it empty to run one in the job")


def _check_settings(env: Dict[str, str], *, groups: int, nproc: int, min_replicas: int) -> None:
    """Resolve ftbridge's settings as each group's rank 0 will: ``ValueError`` now for what the ranks would refuse."""
    from ftbridge.config import FTBridgeConfig
    from ftbridge.log import log_level

    settings = {"REPLICA_GROUP_ID": "0", "NUM_REPLICA_GROUPS": str(groups),
                "FTBRIDGE_MIN_REPLICAS": str(min_replicas), **env}
    try:
        log_level(settings.get("FTBRIDGE_LOG_LEVEL"))
        FTBridgeConfig.resolve(environ=settings, group_rank=0, group_size=nproc)
    except ValueError as exc:
        raise ValueError(f"{exc} (from env= or the component's arguments: every rank would refuse it once "
                         "scheduled)") from None
