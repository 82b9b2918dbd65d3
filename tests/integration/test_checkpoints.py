"""Replica-group checkpoints across jobs of different sizes, writer failover, kills mid-write, SIGTERM.

Every job here is a real LocalJob (lighthouse + one ftbridge-run per replica
group, TINY model); state equality is checked through the per-rank event
logs: ``final`` (the saving job's last state) against ``resumed`` (the state
right after loading), both with the same parameter and per-rank optimizer
checksums (:func:`ftbridge.harness.lm_job.final_digest`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal

import pytest
import torch

from ftbridge import faults
from ftbridge.checkpoint import manifest as mf
from ftbridge.checkpoint.safe_load import safe_load
from ftbridge.checkpoint.store import CheckpointStore
from tests.conftest import TINY


def _run(local_job, groups, args, nproc=2, timeout_s=180, expect=0):
    job = local_job(groups, nproc, [*TINY, *args], max_restarts=0, lighthouse_min_replicas=groups)
    job.start()
    codes = job.wait(timeout_s=timeout_s)
    if expect is not None:
        assert codes == {g: expect for g in range(groups)}, job.tails()
    return job


def _one(job, event, group, rank):
    found = [e for e in job.events(group, rank) if e.get("event") == event]
    assert len(found) == 1, (event, group, rank, found, job.tails())
    return found[0]


def _file_sizes(ckpt_dir):
    return {name: f["bytes"] for name, f in mf.read_manifest(ckpt_dir)["files"].items()}


def _layout(obj, path=""):
    """Every tensor's shape and dtype in a loaded checkpoint file, by its key path (other leaves: their type)."""
    if isinstance(obj, dict):
        return {k: v for key, val in obj.items() for k, v in _layout(val, f"{path}/{key}").items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, val in enumerate(obj) for k, v in _layout(val, f"{path}/{i}").items()}
    if isinstance(obj, torch.Tensor):
        return {path: (tuple(obj.shape), str(obj.dtype))}
    return {path: type(obj).__name__}


def _tensor_layouts(ckpt_dir):
    return {name: _layout(safe_load(os.path.join(ckpt_dir, name))) for name in sorted(os.listdir(ckpt_dir))
            if name.endswith(".pt")}


@pytest.mark.timeout(420)
@pytest.mark.parametrize("stage", [2, pytest.param(1, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow)])
def test_save_with_2_groups_resume_with_1_and_3_groups(local_job, tmp_path, stage):
    ckpt = str(tmp_path / "ckpt")
    common = ["--zero-stage", str(stage), "--checkpoint-every", "2", "--keep-checkpoints", "0"]
    # The saving job writes asynchronously, the resumed ones synchronously: the loaded state must equal the
    # saving job's final state, and the files of both modes must have the same sizes.
    saver = _run(local_job, 2, [*common, "--steps", "4", "--checkpoint-dir", ckpt, "--checkpoint-async"])
    saved = {r: _one(saver, "final", 0, r) for r in (0, 1)}
    writes = [e for e in saver.events() if e.get("event") == "checkpoint_saved"]
    assert sorted(e["step"] for e in writes) == [2, 4] and {e["replica_group"] for e in writes} == {0}
    assert all(e["asynchronous"] for e in writes)
    assert mf.read_latest(ckpt) == "global_step4"

    for groups in (1, 3):
        resumed_dir = str(tmp_path / f"ckpt_{groups}")
        shutil.copytree(ckpt, resumed_dir)
        job = _run(local_job, groups, [*common, "--steps", "6", "--checkpoint-dir", resumed_dir, "--resume"])
        for g in range(groups):
            for r in (0, 1):
                got = _one(job, "resumed", g, r)
                assert got["step"] == 4 and got["global_steps"] == 4
                assert got["params"] == saved[r]["param_checksum"], (groups, g, r)
                assert got["optimizer"] == saved[r]["optimizer_checksum"], (groups, g, r)
                assert got["scheduler_step"] == saved[r]["scheduler_step"] and got["lr"] == saved[r]["lr"]
            committed = [e["step"] for e in job.steps(g) if e["committed"]]
            assert committed == [5, 6], (groups, g, committed)  # steps continue from the saved step
            assert {e["participants"] for e in job.steps(g)} == {groups}
        finals = [e for e in job.events() if e.get("event") == "final"]
        assert len({f["param_checksum"] for f in finals}) == 1  # all groups agree after training on
        assert finals[0]["param_checksum"] != saved[0]["param_checksum"]
        # This job's own checkpoint of step 6 has the same files and sizes as the 2-group job's of step 4.
        sizes = _file_sizes(os.path.join(resumed_dir, "global_step6"))
        reference = _file_sizes(os.path.join(ckpt, "global_step4"))
        meta = sizes.pop("ftbridge.json"), reference.pop("ftbridge.json")
        assert sizes.keys() == reference.keys(), groups  # the same DeepSpeed shards and per-rank files
        if stage != 3:  # ZeRO-3: a resumed engine's empty parameter placeholders no longer share one storage,
            assert sizes == reference, groups  # so torch.save writes one zip entry each (~130 bytes): byte counts
        layouts = _tensor_layouts(os.path.join(resumed_dir, "global_step6"))
        assert layouts == _tensor_layouts(os.path.join(ckpt, "global_step4")), groups  # every tensor's shape, dtype
        assert abs(meta[0] - meta[1]) <= 8  # JSON metadata: only digit counts (participants, batches) differ

    # Another group size is refused before anything is loaded, naming both sizes and the conversion.
    refused = _run(local_job, 1, [*common, "--steps", "6", "--checkpoint-dir", ckpt, "--resume"], nproc=1,
                   expect=None)
    assert refused.wait(timeout_s=60)[0] != 0
    log = refused.log_text(0)
    assert "saved by replica groups of 2 ranks, but this replica group has 1 ranks" in log, refused.tails()
    assert "nothing was loaded" in log and "ds_to_universal" in log
    assert not [e for e in refused.events() if e.get("event") in ("checkpoint_loaded", "resumed")]
    assert not refused.steps(0)


@pytest.mark.timeout(420)
def test_writer_group_killed_before_scheduled_save_other_group_writes_it_once(local_job, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    job = local_job(2, 2, [*TINY, "--steps", "100000", "--checkpoint-dir", ckpt, "--checkpoint-every", "1",
                           "--keep-checkpoints", "0"], max_restarts=0,
                    env={"FTBRIDGE_SYNC_MODE": "post_backward", faults.ENV_DIR: str(tmp_path / "faults")})
    # Killed once in the step's quorum, before its all-reduce: group 1's all-reduce of that step then
    # fails for sure (killing after backward raced the all-reduce).
    job.script_args += ["--stop-file", f"{job.workdir}/stop"]
    job.start(groups=[0])
    job.wait_step(0, 1, timeout_s=120)
    job.start_group(1)
    job.wait_until(lambda: sum(e["committed"] and e["participants"] == 2 for e in job.steps(1)) >= 2, 120,
                   "both groups to commit together")
    faults.arm(str(tmp_path / "faults"), "in_allreduce", group=0, rank=0)  # the writer dies inside its next step
    job.wait_until(lambda: faults.fired(str(tmp_path / "faults"), "in_allreduce"), 120, "the fault to fire")
    fault_step = int(re.search(r"after joining the quorum of step (\d+)", job.log_text(0)).group(1))
    job.wait_step(1, fault_step + 3, timeout_s=120)
    job.stop_soon(1)
    assert job.wait(timeout_s=120, groups=[1]) == {1: 0}, job.tails()

    saves = [e for e in job.events() if e.get("event") == "checkpoint_saved"]
    steps = [e["step"] for e in saves]
    assert len(steps) == len(set(steps)), f"a step was checkpointed twice: {steps}"
    by = {e["step"]: e["replica_group"] for e in saves}
    # The step group 0 died in was committed by group 1 alone (new quorum, replica rank 0): it wrote it.
    assert by[fault_step + 1] == 1, by
    assert all(by[s] == 0 for s in by if s <= fault_step and s in by)
    meta = json.load(open(os.path.join(ckpt, f"global_step{fault_step + 1}", "ftbridge.json")))
    assert meta["quorum"]["replica_group_id"] == 1 and meta["quorum"]["participants"] == 1
    assert not [c for c in CheckpointStore(ckpt).list() if c.problems()]


@pytest.mark.timeout(360)
def test_killed_mid_write_latest_stays_previous_restart_falls_back_then_on_demand_and_sigterm_saves(local_job,
                                                                                                      tmp_path):
    ckpt = str(tmp_path / "ckpt")
    fault_dir = str(tmp_path / "faults")
    job = local_job(1, 2, [*TINY, "--steps", "100000", "--checkpoint-dir", ckpt, "--checkpoint-every", "2",
                           "--resume"], max_restarts=0, env={faults.ENV_DIR: fault_dir})
    job.start()  # --resume with an empty folder starts from step 0
    job.wait_until(lambda: len(_saves(job)) >= 2, 120, "two checkpoints")
    faults.arm(fault_dir, "checkpoint_publish", group=0, rank=0)
    job.wait_until(lambda: faults.fired(fault_dir, "checkpoint_publish"), 120, "the fault to fire")
    assert job.wait(timeout_s=60)[0] != 0
    published = [e["step"] for e in job.events(0, 0) if e.get("event") == "checkpoint_saved"]
    killed = int(re.search(r"before publishing .*global_step(\d+)", job.log_text(0)).group(1))
    assert killed == published[-1] + 2
    assert mf.read_latest(ckpt) == f"global_step{published[-1]}"
    assert [c.step for c in CheckpointStore(ckpt).list()][-1] == published[-1]
    assert any(n.startswith(f".tmp-global_step{killed}-") for n in os.listdir(ckpt))  # written, never published

    # The newest published checkpoint loses bytes of a shard: the restart must fall back past it.
    bad_shard = os.path.join(ckpt, f"global_step{published[-1]}", "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    os.truncate(bad_shard, 100)

    # The group restarts with no live peer: it resumes from the newest valid checkpoint, not step 0.
    # This launch saves only on demand (trigger file) and on SIGTERM, asynchronously.
    # The point fired once (its trigger renamed): the restart is not killed again.
    assert faults.fired(fault_dir, "checkpoint_publish") and not os.path.exists(f"{fault_dir}/checkpoint_publish")
    job.script_args += ["--checkpoint-every", "0", "--checkpoint-async"]
    job.start_group(0)
    job.wait_until(lambda: any(e.get("event") == "checkpoint_loaded" for e in job.events(0, 0)), 120, "resume")
    loaded = [e for e in job.events(0, 0) if e.get("event") == "checkpoint_loaded"]
    assert [e["step"] for e in loaded] == [published[-2]]
    assert f"cannot be trusted, skipping it: {bad_shard}: 100 bytes" in job.log_text(0), job.tails()
    job.wait_step(0, published[-2] + 1, timeout_s=60, since=loaded[0]["time"])
    job.write_file("../ckpt/SAVE_NOW", "")
    job.wait_until(lambda: len(_saves(job)) == len(published) + 1, 120, "the on-demand save")
    assert not os.path.exists(os.path.join(ckpt, "SAVE_NOW"))
    job.kill_workers(0, sig=signal.SIGTERM)  # graceful stop: finish the step, save, exit 0
    assert job.wait(timeout_s=120) == {0: 0}, job.tails()
    saves = _saves(job)[len(published):]
    assert len(saves) == 2 and all(e["asynchronous"] for e in saves), saves
    # Steps of this launch only: the first launch committed up to the killed save's step, which this one
    # may not reach before the SIGTERM (the max over both launches failed the test once here).
    stop_step = max(e["step"] for e in job.steps(0) if e["committed"] and e["time"] > loaded[0]["time"])
    assert saves[-1]["step"] == stop_step and mf.read_latest(ckpt) == f"global_step{stop_step}"
    assert "SIGTERM: stopping after step" in job.log_text(0)
    # Everything published since verifies (the damaged one is still there, or was moved aside by a re-save).
    assert [c.step for c in CheckpointStore(ckpt).list() if c.problems()] in ([], [published[-1]])


def _saves(job):
    return [e for e in job.events(0, 0) if e.get("event") == "checkpoint_saved"]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_restarted_group_loads_checkpoint_then_heals_from_live_peer_ahead(local_job, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    job = local_job(2, 2, [*TINY, "--steps", "100000", "--checkpoint-dir", ckpt, "--checkpoint-every", "3",
                           "--resume"], max_restarts=1)
    job.script_args += ["--stop-file", f"{job.workdir}/stop"]
    job.start()
    job.wait_until(lambda: any(e.get("event") == "checkpoint_saved" and e["step"] >= 6 for e in job.events()),
                   120, "a checkpoint at step 6 or later")
    kill_time = job.events()[-1]["time"]
    job.kill_workers(1)  # torchrun restarts group 1 with --resume; group 0 trains on alone
    job.wait_heal(1, kill_time, 180, "restarted group 1 to heal")
    job.stop_soon()
    assert job.wait(timeout_s=180) == {0: 0, 1: 0}, job.tails()

    loaded = [e for e in job.events(1, 0) if e.get("event") == "checkpoint_loaded" and e["time"] > kill_time]
    healed = [e for e in job.steps(1) if e["healed"] and e["time"] > kill_time]
    assert len(loaded) == 1 and len(healed) == 1, (loaded, healed)
    # The live peer was ahead of the checkpoint: its state won through the heal.
    assert healed[0]["step"] > loaded[0]["step"] >= 6
    finals = [e for e in job.events() if e.get("event") == "final"]
    assert len(finals) == 4 and len({f["param_checksum"] for f in finals}) == 1, finals
    for r in (0, 1):
        assert len({f["optimizer_checksum"] for f in finals if f["group_rank"] == r}) == 1
