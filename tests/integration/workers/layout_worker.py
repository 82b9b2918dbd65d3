"""Worker for tests/integration/test_comm_hooks_layout.py: run by torchrun with 2 ranks.

For ZeRO stages 1, 2 and 3, builds the engine with PowerSGD over a scripted
single-replica manager, runs one backward on the same batch on both ranks (so
the in-group average is the plain gradient), and checks every fragment of
the rank's layout against a reference model's gradient at the fragment's
parameter offsets. Prints ``LAYOUT OK stage S rank R fragments F cut C``.
"""

import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

import deepspeed
import torch
import torch.distributed as dist

from ftbridge.harness.models import GPTConfig, build_model
from tests.fakes import TINY_GPT, gpt_batch, tiny_engine

deepspeed.init_distributed(dist_backend="gloo")
rank = dist.get_rank()
gcfg = GPTConfig(**TINY_GPT)
x, y = gpt_batch(0)
ref = build_model(gcfg, seed=3)
ref(x, y)[1].backward()
ref_grads = {n: p.grad.reshape(-1) for n, p in ref.named_parameters()}
for stage in (1, 2, 3):
    model = build_model(gcfg, seed=3)
    names = {tuple(p.shape): [] for p in model.parameters()}
    for n, p in model.named_parameters():
        names[tuple(p.shape)].append(n)
    eng = tiny_engine(stage, model=model, ds={"zero_optimization": {"stage3_param_persistence_threshold": 0}},
                      ft={"group_rank": rank, "group_size": 2, "comm_hook": "power_sgd",
                          "comm_state_option": {"start_powerSGD_iter": 0}})
    _, loss = eng(x, y)
    eng.backward(loss)
    flat = torch.cat([t.reshape(-1).float() for t in eng.adapter.partition_grads()])
    layout = eng.sync.hook_state.layout
    assert layout.numel == flat.numel(), (layout.numel, flat.numel())
    cut = 0
    for f in layout.fragments:
        got = flat[f.offset:f.offset + f.numel]
        ok = [n for n in names[f.shape]
              if torch.allclose(got, ref_grads[n][f.param_start:f.param_start + f.numel], rtol=1e-3, atol=1e-6)]
        assert ok, f"stage {stage} rank {rank}: fragment {f} matches no parameter of shape {f.shape}"
        cut += f.numel < torch.Size(f.shape).numel()
    assert cut > 0, f"stage {stage} rank {rank}: no parameter was cut; the test model is too small"
    eng.step()
    print(f"LAYOUT OK stage {stage} rank {rank} fragments {len(layout.fragments)} cut {cut}", flush=True)
sys.stdout.flush()
os._exit(0)
