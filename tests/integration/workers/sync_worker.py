"""One rank of one replica group for the property test: runs job after job, read from stdin.

Started once per (group, group rank) by ``tests/integration/sync_pool.py``. The
replica group's own world (gloo, ``group_size`` ranks) is the default process
group, as under ``ftbridge-run``; the cross-replica process group is a real
gloo group of the same group rank in every replica group, driven through a
stand-in for ftbridge's ``ReplicaManager`` (fixed membership: every group
participates, no torchft quorum; the sync, the bucket hooks, the commit path
and DeepSpeed are the real ones).

Protocol: one JSON line per job on stdin (``{"spec": JobSpec JSON, "out": path}``);
one line per job on stdout starting with ``@@`` and holding
``{"ok": bool, "error": str, "committed": [...], "issued_in_backward": int}``.
Group rank 0 writes the full parameters to ``out`` (safetensors). An
exception in a job is answered and ends the worker (the collectives of its
peers would no longer pair).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from tests.fakes import FakeManager


class Finished:
    """A work whose result is ready after ``then`` runs."""

    def __init__(self, work, then=None):
        self.work, self.then = work, then

    def wait(self, timeout=None):
        self.work.wait()
        if self.then is not None:
            self.then()
        return True


class GlooReplicaManager(FakeManager):
    """:class:`tests.fakes.FakeManager` over a real gloo cross-replica group; every group participates,
    nothing heals, and a step commits unless an error was reported."""

    pg = None  # set by main(): the cross-replica ProcessGroupGloo
    groups = 1
    group_id = 0

    def __init__(self, cfg, *, state_dict, load_state_dict, use_cuda=False, max_heal_bytes=None):
        super().__init__(cfg, state_dict=state_dict, load_state_dict=load_state_dict)
        self.participants = type(self).groups
        self.replica_rank = type(self).group_id

    def step_members(self):
        """Every replica group is a member of every step's quorum, and none heals."""
        return tuple(f"replica_group_{g}:sync" for g in range(type(self).groups)), True

    def allreduce(self, tensor, reduce_op=ReduceOp.AVG):
        opts = dist.AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        work = type(self).pg.allreduce([tensor], opts)
        if reduce_op == ReduceOp.AVG:
            return Finished(work, lambda: tensor.div_(self.participants))
        return Finished(work)


def run_job(spec, out):
    from safetensors.torch import save_file

    import ftbridge
    from ftbridge.config import FTBridgeConfig
    from tests.sync_model import BranchNet, batch

    g, r = GlooReplicaManager.group_id, dist.get_rank()
    model = BranchNet(spec)
    cfg = FTBridgeConfig.resolve(environ={}, replica_group_id=g, num_replica_groups=spec.groups, group_rank=r,
                                 group_size=spec.group_size, sync_mode=spec.sync_mode,
                                 cross_replica_bucket_bytes=spec.message_bytes, checksum_every=0, slots=spec.slots)
    eng, *_ = ftbridge.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=spec.lr),
                                  config=spec.ds_config(), ft_config=cfg, manager_factory=GlooReplicaManager)
    committed = []
    dtype = torch.bfloat16 if spec.bf16 else torch.float32
    for s in range(spec.steps):
        xs = [(batch(spec, s, g, r, m).to(dtype), list(spec.use[s][g][m])) for m in range(spec.micro)]
        if spec.slots:  # this group's units of the grid: the slot's rows and branches, whichever group it is
            for u in eng.units():
                eng.backward(eng(batch(spec, s, u.slot, r, u.micro).to(dtype), list(spec.use[s][u.slot][u.micro])))
                eng.step()
        elif spec.pattern == "managed":
            for x, use in xs:
                eng.backward(eng(x, use))
                eng.step()
        elif spec.pattern == "manual":
            for m, (x, use) in enumerate(xs):
                eng.set_gradient_accumulation_boundary(m == spec.micro - 1)
                eng.backward(eng(x, use))
            eng.step()
        elif spec.pattern == "unmanaged":
            for x, use in xs:
                eng.backward(eng(x, use))
            eng.step()
        elif spec.pattern == "no_sync":   # ZeRO-1 only (DeepSpeed refuses no_sync with stages 2 and 3)
            with eng.no_sync():
                for x, use in xs[:-1]:
                    eng.backward(eng(x, use))
            x, use = xs[-1]
            eng.backward(eng(x, use))
            eng.step()
        elif spec.pattern == "coalesce":
            with eng.coalesce_grad_reduction():
                for x, use in xs:
                    eng.backward(eng(x, use))
            eng.step()
        else:
            raise ValueError(f"unknown pattern {spec.pattern!r}")
        committed.append(eng.last_committed)
    params = eng.adapter.full_parameters()
    names = [n for n, _ in eng.module.named_parameters()]
    if r == 0:
        save_file({n: p.detach().float().contiguous().clone() for n, p in zip(names, params)}, out)
    issued = eng.sync.issued_in_backward
    eng.engine.destroy()
    return {"committed": committed, "issued_in_backward": issued}


def main() -> None:
    group, groups = int(os.environ["SYNC_GROUP"]), int(os.environ["SYNC_GROUPS"])
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    folder = os.environ["SYNC_STORE_DIR"]
    timeout = datetime.timedelta(seconds=float(os.environ.get("SYNC_TIMEOUT_S", "60")))
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(folder, f"group{group}"), size),
                            rank=rank, world_size=size, timeout=timeout)
    cross_store = dist.FileStore(os.path.join(folder, f"cross{rank}"), groups)
    GlooReplicaManager.pg = dist.ProcessGroupGloo(cross_store, group, groups, timeout)
    GlooReplicaManager.groups, GlooReplicaManager.group_id = groups, group
    from tests.sync_model import JobSpec

    print("@@" + json.dumps({"ok": True, "ready": True}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        try:
            reply = {"ok": True, **run_job(JobSpec.from_json(job["spec"]), job["out"])}
        except Exception as e:  # noqa: BLE001 - answered, then the worker ends: its peers' collectives no longer pair
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        print("@@" + json.dumps(reply), flush=True)
        if not reply["ok"]:
            break
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
