"""FaultTolerantTrainer after failures: a restarted replica group heals into the Trainer's loop, and a resume
takes the newest whole checkpoint.

Both run the worker of ``test_trainer_equivalence.py`` (tiny GPT-2, ZeRO-2, 40 rows: with 2 groups x 1 rank,
10 steps an epoch, 2 epochs).

* Heal: group 1 SIGKILLs itself after step 4; the lighthouse needs both groups for a quorum, so group 0
  waits for the restart, which heals from it. The restarted Trainer begins at its own step 0; it must
  continue at group 0's ``global_step``, read the rows plain data-parallel rank 1 reads at each later step
  (across the epoch's end), step the learning rate with group 0 and stop with it, holding group 0's model.
* Checkpoints: 2 groups save every 5 steps to step 10 (group 0 writes, each checkpoint sealed); the newest
  is then truncated, as a writer killed mid-save leaves it; 1 group (3 under ``-m slow``) resumes with
  ``resume_from_checkpoint=True`` and must start after step 5 (all groups identical at the end).
"""

from __future__ import annotations

import os

import pytest
import torch

from ftbridge.harness import local_job as local_job_module
from tests.integration.test_trainer_equivalence import WORKER

KILL_AT = 4
ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("group_size", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_restarted_group_continues_the_trainers_run_and_a_resume_takes_the_newest_whole_checkpoint(
        local_job, tmp_path, group_size):
    pytest.importorskip("transformers")
    ft_out, plain_out, ckpts = tmp_path / "ft", tmp_path / "plain", tmp_path / "trainer"
    rows = ["--rows", str(40 * group_size)]  # 10 steps an epoch at any group size
    job = local_job(2, group_size, ["--out", str(ft_out), "--kill-at", str(KILL_AT), "--output-dir", str(ckpts),
                                    "--save-steps", "5", *rows], script=WORKER, min_replicas=2,
                    lighthouse_min_replicas=2, max_restarts=1, env={**ENV, "FTBRIDGE_QUORUM_TIMEOUT_S": "120"})
    job.start()
    local_job_module.run_plain_deepspeed(str(tmp_path), 2 * group_size, ["--out", str(plain_out), *rows], 240,
                                         script=WORKER)
    assert job.wait(timeout_s=300) == {0: 0, 1: 0}, job.tails()
    ft = [torch.load(ft_out / f"result_{r}.pt") for r in range(2 * group_size)]
    plain = [torch.load(plain_out / f"result_{r}.pt") for r in range(2 * group_size)]
    for r in range(group_size):  # every rank of a group holds the same place in the run as the group's rank 0
        assert ft[r]["global_steps"] == ft[0]["global_steps"]
        assert ft[group_size + r]["global_steps"] == ft[group_size]["global_steps"]
        for g in (0, 1):
            got, want = ft[g * group_size + r], plain[g * group_size + r]
            for step in got["global_steps"][1:]:
                assert got["step_rows"][step] == want["step_rows"][step], f"group {g} rank {r}'s rows at step {step}"

    live, healed = ft[0], ft[group_size]
    assert live["restart"] == 0 and healed["restart"] == 1, "group 1's result comes from its restarted process"
    _assert_joined_the_run(live, healed, plain)

    _resume_after_cutting_the_newest(local_job, tmp_path, ckpts, [5, 10, 15, 20], groups=1, group_size=group_size,
                                     extra=rows)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_resume_by_3_groups_takes_the_newest_whole_checkpoint_2_groups_wrote(local_job, tmp_path):
    pytest.importorskip("transformers")
    ckpts = tmp_path / "trainer"
    saver = local_job(2, 1, ["--out", str(tmp_path / "r1"), "--output-dir", str(ckpts), "--save-steps", "5",
                             "--max-steps", "10"], script=WORKER, min_replicas=2, lighthouse_min_replicas=2,
                      max_restarts=0, env=ENV)
    saver.start()
    assert saver.wait(timeout_s=240) == {0: 0, 1: 0}, saver.tails()
    _resume_after_cutting_the_newest(local_job, tmp_path, ckpts, [5, 10], groups=3)


@pytest.mark.slow  # ~1 min; the same path as the restart above once the spare holds the id
@pytest.mark.timeout(480)
def test_a_warm_spare_takes_the_killed_groups_place_in_the_trainers_run(local_job, tmp_path):
    """Group 1 killed for good after step 4 (no torchrun restart); a warm spare, built before it knew which
    group it would train as, takes id 1, heals, and reads plain rank 1's rows from there on."""
    pytest.importorskip("transformers")
    ft_out, plain_out = tmp_path / "ft", tmp_path / "plain"
    job = local_job(2, 1, ["--out", str(ft_out), "--kill-at", str(KILL_AT)], script=WORKER, min_replicas=2,
                    lighthouse_min_replicas=2, max_restarts=0, env={**ENV, "FTBRIDGE_QUORUM_TIMEOUT_S": "120"})
    job.start()
    job.start_spare(0)
    local_job_module.run_plain_deepspeed(str(tmp_path), 2, ["--out", str(plain_out)], 240, script=WORKER)
    codes = job.wait(timeout_s=300)
    assert codes[0] == 0 and codes[1] != 0, job.tails()
    assert job.wait_spare(0, timeout_s=120) == 0, job.tails()
    ft = [torch.load(ft_out / f"result_{r}.pt") for r in range(2)]
    plain = [torch.load(plain_out / f"result_{r}.pt") for r in range(2)]
    assert not ft[0]["spare"] and ft[1]["spare"], "group 1's result comes from the spare"
    for step in ft[1]["global_steps"][1:]:
        assert ft[1]["step_rows"][step] == plain[1]["step_rows"][step], f"the spare's rows at step {step}"
    _assert_joined_the_run(ft[0], ft[1], plain)


def _assert_joined_the_run(live, joined, plain):
    """``joined`` (a restart or a spare) took ``live``'s place in the run at its first step, after the kill and
    in the first epoch, then stepped, scheduled and stopped with it and ends with its model."""
    first = joined["global_steps"][0]
    assert KILL_AT < first <= plain[0]["max_steps"] // 2, f"healed at step {first}: before the epoch end"
    assert joined["global_steps"] == list(range(first, live["max_steps"] + 1)), "one step at a time, to max_steps"
    assert live["global_steps"][-1] == joined["global_steps"][-1] == plain[0]["max_steps"] == 20
    tail = live["global_steps"].index(first)
    assert joined["lrs"] == live["lrs"][tail:], "the learning rate of every step the groups shared"
    assert live["step_rows"][1] == plain[0]["step_rows"][1]
    assert [step for step, _ in live["logs"]] == list(range(1, 21))  # logging_steps=1
    assert joined["logs"][:first - 1] == live["logs"][:first - 1], "the run's logs before the heal, the donor's"
    assert [step for step, _ in joined["logs"]] == list(range(1, 21))
    for name, value in live["params"].items():
        assert torch.equal(joined["params"][name], value), f"{name}: the groups differ"


def _resume_after_cutting_the_newest(local_job, tmp_path, ckpts, steps, groups, group_size=1, extra=()):
    """Checks ``ckpts`` holds sealed ``checkpoint-<step>`` for ``steps``, cuts the newest's largest file in
    half (as a writer killed mid-save leaves it), and resumes ``groups`` groups to 2 steps past it: each must
    start after the checkpoint before it, name the one it skipped, and end identical."""
    assert sorted(os.listdir(ckpts)) == sorted(f"checkpoint-{s}" for s in steps)
    for step in steps:
        assert os.path.isfile(ckpts / f"checkpoint-{step}" / "manifest.json"), f"checkpoint-{step} is sealed"
    newest = ckpts / f"checkpoint-{steps[-1]}"
    shard = max((p for p in newest.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    os.truncate(shard, shard.stat().st_size // 2)
    resumer = local_job(groups, group_size, ["--out", str(tmp_path / "resumed"), "--output-dir", str(ckpts),
                                             "--resume", "--max-steps", str(steps[-1] + 2), *extra],
                        script=WORKER, min_replicas=groups, lighthouse_min_replicas=groups, max_restarts=0, env=ENV)
    resumer.start()
    assert resumer.wait(timeout_s=300) == {g: 0 for g in range(groups)}, resumer.tails()
    got = [torch.load(tmp_path / "resumed" / f"result_{r}.pt") for r in range(groups * group_size)]
    for g, result in enumerate(got):
        assert result["global_steps"][0] == steps[-2] + 1, f"group {g} resumed from checkpoint-{steps[-2]}"
        assert result["global_steps"][-1] == steps[-1] + 2
        for name, value in got[0]["params"].items():
            assert torch.equal(result["params"][name], value), f"group {g}: {name} differs from group 0's"
    assert f"checkpoint-{steps[-1]}: not a whole sealed checkpoint" in resumer.log_text(0), "the skipped one is named"
