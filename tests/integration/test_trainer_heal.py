"""FaultTolerantTrainer: a replica group killed mid-run, restarted by torchrun, heals into the Trainer's loop.

2 groups x 1 rank run the worker of ``test_trainer_equivalence.py`` (tiny GPT-2, ZeRO-2, 40 rows: 10 steps an
epoch, 2 epochs). Group 1 SIGKILLs itself after step 4; the lighthouse needs both groups for a quorum, so
group 0 waits for the restart, which heals from it. The restarted Trainer begins at its own step 0; it must
continue at group 0's ``global_step``, read the rows plain data-parallel rank 1 reads at each later step
(across the epoch's end), step the learning rate with group 0 and stop with it, holding group 0's model.
"""

from __future__ import annotations

import pytest
import torch

from ftbridge.harness import local_job as local_job_module
from tests.integration.test_trainer_equivalence import WORKER

KILL_AT = 4


@pytest.mark.timeout(420)
def test_a_restarted_group_continues_the_trainers_run_where_the_live_group_is(local_job, tmp_path):
    pytest.importorskip("transformers")
    ft_out, plain_out = tmp_path / "ft", tmp_path / "plain"
    job = local_job(2, 1, ["--out", str(ft_out), "--kill-at", str(KILL_AT)], script=WORKER, min_replicas=2,
                    lighthouse_min_replicas=2, max_restarts=1,
                    env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "FTBRIDGE_QUORUM_TIMEOUT_S": "120"})
    job.start()
    local_job_module.run_plain_deepspeed(str(tmp_path), 2, ["--out", str(plain_out)], 240, script=WORKER)
    assert job.wait(timeout_s=300) == {0: 0, 1: 0}, job.tails()
    ft = [torch.load(ft_out / f"result_{r}.pt") for r in range(2)]
    plain = [torch.load(plain_out / f"result_{r}.pt") for r in range(2)]

    live, healed = ft
    assert live["restart"] == 0 and healed["restart"] == 1, "group 1's result comes from its restarted process"
    first = healed["global_steps"][0]
    assert KILL_AT < first <= plain[0]["max_steps"] // 2, f"the restart healed at step {first}: before the epoch end"
    assert healed["global_steps"] == list(range(first, live["max_steps"] + 1)), "one step at a time, to max_steps"
    assert live["global_steps"][-1] == healed["global_steps"][-1] == plain[0]["max_steps"]
    tail = live["global_steps"].index(first)
    assert healed["lrs"] == live["lrs"][tail:], "the learning rate of every step the groups shared"
    for step in healed["global_steps"][1:]:  # the heal step's own gradient is not counted (zeroed by torchft)
        assert healed["step_rows"][step] == plain[1]["step_rows"][step], f"group 1's rows at step {step}"
    for step in live["global_steps"]:
        assert live["step_rows"][step] == plain[0]["step_rows"][step], f"group 0's rows at step {step}"
    for name, value in live["params"].items():
        assert torch.equal(healed["params"][name], value), f"{name}: the groups differ"
