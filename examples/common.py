"""Shared body of the communication-hook examples: a tiny model trained by 2 replica groups.

Each example (``python examples/fp16.py`` ...) calls :func:`run` with its
``"ftbridge"`` DeepSpeed-config section. Started without torchrun it
launches itself as a whole local job (lighthouse + 2 replica groups x 1 rank,
:class:`ftbridge.harness.local_job.LocalJob`) and prints every group's last line;
under ``ftbridge-run`` (``RANK`` set) it trains::

    ftbridge-lighthouse serve --bind 127.0.0.1:29510 &
    ftbridge-run --replica-group-id 0 --num-replica-groups 2 --nproc-per-node 1 -- examples/fp16.py
    ftbridge-run --replica-group-id 1 --num-replica-groups 2 --nproc-per-node 1 -- examples/fp16.py
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Dict, Optional

STEPS = 30


def run(script: str, section: Dict[str, Any], comm_hook: Optional[Callable] = None) -> None:
    """Train under ftbridge-run, or launch this example as a 2-group local job."""
    if "RANK" not in os.environ:
        _launch(script)
    else:
        _train(section, comm_hook)


def _train(section: Dict[str, Any], comm_hook: Optional[Callable]) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch

    import ftbridge

    torch.manual_seed(0)           # same initial model in every replica group
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64))
    ds_config = {"train_micro_batch_size_per_gpu": 16, "gradient_clipping": 1.0, "steps_per_print": 10**9,
                 "zero_optimization": {"stage": 2}, "ftbridge": section}
    engine, *_ = ftbridge.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3),
                                     config=ds_config, comm_hook=comm_hook)
    cfg = engine.cfg
    group, dp_rank = cfg.replica_group_id, cfg.replica_group_id * cfg.group_size + cfg.group_rank
    target = torch.randn(64, 64, generator=torch.Generator().manual_seed(1)) / 8
    while engine.global_steps < STEPS:
        # Each step's batch is a function of the step and the data-parallel rank (docs/your-script.md): a
        # discarded step is retried on the same data, a healed group resumes where its peers are.
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(engine.global_steps * 1009 + dp_rank))
        loss = torch.nn.functional.mse_loss(engine(x), torch.tanh(x @ target))
        engine.backward(loss)
        engine.step()
    extra = " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in engine.sync.hook_state.describe().items())
    print(f"[replica {group}] step {engine.global_steps} loss {float(loss):.4f} "
          f"cross-replica bytes {engine.sync.bytes_sent:,} in {engine.sync.allreduces} all-reduces {extra}",
          flush=True)
    engine.shutdown()
    sys.stdout.flush()
    os._exit(0)   # DeepSpeed's threads can abort interpreter shutdown on CPU


def _launch(script: str) -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from ftbridge.harness.local_job import run_script_locally

    if run_script_locally(script) != 0:
        raise SystemExit(1)
