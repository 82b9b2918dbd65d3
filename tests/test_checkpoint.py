"""Unit tests of the checkpoint package: writer election, manifest, store, snapshot, CLI (no network)."""

from __future__ import annotations

import io
import logging
import os
import random
import signal
import threading

import pytest
import torch

from ftbridge.checkpoint import manifest as mf
from ftbridge.checkpoint.async_save import BackgroundWriter, snapshot
from ftbridge.checkpoint.cli import main as ckpt_cli
from ftbridge.checkpoint.store import (
    CheckpointStore,
    GroupSizeMismatchError,
    NoValidCheckpointError,
    SlotsMismatchError,
    check_compatible,
    check_metadata,
    tag_for,
)
from ftbridge.checkpoint.writer import is_writer, replica_ranks, save_due


# -- writer election ------------------------------------------------------------------------------
def _random_quorum(rng):
    ids = rng.sample([f"replica_group_{i}" for i in range(12)], rng.randint(1, 8))
    top = rng.randint(0, 100)
    return {r: top - (rng.random() < 0.3) * rng.randint(1, 5) for r in ids} | {ids[0]: top}


def test_exactly_one_writer_per_committed_quorum():
    rng = random.Random(0)
    for _ in range(2000):
        members = _random_quorum(rng)
        ranks = replica_ranks(members)
        writers = [r for r in members if is_writer(ranks[r], committed=True)]
        assert len(writers) == 1, (members, ranks)
        top = max(members.values())
        # the writer is a participant (at the quorum's step), never a healing group
        assert members[writers[0]] == top
        assert all(ranks[r] is None for r, s in members.items() if s < top)


def test_two_writers_for_one_step_impossible_across_failover():
    """Writer dies before committing step 10: the step is retried in the next quorum, whose rank 0 writes it."""
    committed_by = {}  # step -> the one quorum that committed it
    q1 = {"replica_group_0": 9, "replica_group_1": 9, "replica_group_2": 9}
    committed_by[9] = q1
    # replica_group_0 dies during step 10: q1 does not commit it; q2 without the dead group does.
    q2 = {"replica_group_1": 9, "replica_group_2": 9}
    committed_by[10] = q2
    # replica_group_0 restarts (at step 0) and heals in step 11.
    q3 = {"replica_group_0": 0, "replica_group_1": 10, "replica_group_2": 10}
    committed_by[11] = q3
    writers = {}
    for step, quorum in committed_by.items():
        ranks = replica_ranks(quorum)
        writers[step] = [r for r in quorum if is_writer(ranks[r], committed=True)]
    assert writers == {9: ["replica_group_0"], 10: ["replica_group_1"], 11: ["replica_group_1"]}
    # A group that did not commit (its quorum was torn down) never writes.
    assert not is_writer(0, committed=False)
    assert not is_writer(None, committed=True)


def test_save_due_schedule_and_requests():
    assert [s for s in range(0, 11) if save_due(s, 5)] == [5, 10]
    assert not save_due(0, 1, requested=True)  # nothing trained yet
    assert save_due(3, 0, requested=True) and save_due(3, 0, stopping=True) and not save_due(3, 0)


# -- manifest and store ---------------------------------------------------------------------------
def make_checkpoint(root, step, group_size=2, stage=2, publish=True, quorum_id=1, payload=b""):
    store = CheckpointStore(str(root))
    tag = tag_for(step)
    staged = os.path.join(store.staging_dir(tag, quorum_id), tag)
    os.makedirs(staged)
    files = ["mp_rank_00_model_states.pt", *(f"zero_pp_rank_{k}_mp_rank_00_optim_states.pt" for k in range(group_size)),
             *(f"ftbridge_rank_{k}.pt" for k in range(group_size))]
    for i, name in enumerate(files):  # small real torch files (verify also loads them with the safe loader)
        torch.save({"step": step, "file": i, "pad": torch.full((500,), i, dtype=torch.int16), "payload": list(payload)},
                   os.path.join(staged, name))
    mf.write_json_atomic(os.path.join(staged, "ftbridge.json"),
                         {"step": step, "group_size": group_size, "zero_stage": stage,
                          "quorum": {"quorum_id": quorum_id, "participants": 2, "replica_rank": 0,
                                     "replica_group_id": 0}})
    mf.write_manifest(staged, {"tag": tag, "step": step})
    if publish:
        assert mf.publish(staged, store.root, tag)
        mf.update_latest(store.root, tag)
    return os.path.join(str(root), tag)


def test_publish_is_atomic_once_and_staging_is_invisible(tmp_path):
    make_checkpoint(tmp_path, 2)
    make_checkpoint(tmp_path, 4, publish=False)  # a writer killed before the rename
    store = CheckpointStore(str(tmp_path))
    assert [c.tag for c in store.list()] == ["global_step2"]
    assert mf.read_latest(str(tmp_path)) == "global_step2"
    assert store.find_valid().tag == "global_step2"
    # A second publish of the same step is refused and leaves the first untouched.
    other = tmp_path / "other" / "global_step2"
    other.mkdir(parents=True)
    assert not mf.publish(str(other), str(tmp_path), "global_step2")
    assert store.list()[0].problems() == []


@pytest.mark.parametrize("damage", ["truncate", "alter", "delete"])
def test_bad_shard_falls_back_with_warning_naming_the_file(tmp_path, caplog, damage):
    make_checkpoint(tmp_path, 2)
    newest = make_checkpoint(tmp_path, 4)
    shard = os.path.join(newest, "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    if damage == "truncate":
        os.truncate(shard, 10)
    elif damage == "alter":
        with open(shard, "r+b") as f:
            f.seek(5)
            f.write(b"\xff")
    else:
        os.remove(shard)
    with caplog.at_level(logging.WARNING):
        found = CheckpointStore(str(tmp_path)).find_valid()
    assert found.tag == "global_step2"
    assert shard in caplog.text and "global_step4" in caplog.text


def test_no_valid_checkpoint_is_a_clear_error(tmp_path):
    for step in (2, 4):
        path = make_checkpoint(tmp_path, step)
        os.remove(os.path.join(path, "manifest.json"))
    with pytest.raises(NoValidCheckpointError, match=r"no valid checkpoint .*global_step2.*global_step4"):
        CheckpointStore(str(tmp_path)).find_valid()
    assert CheckpointStore(str(tmp_path / "empty")).find_valid() is None


def test_missing_rank_file_is_detected_even_if_manifest_agrees(tmp_path):
    path = make_checkpoint(tmp_path, 2)
    os.remove(os.path.join(path, "ftbridge_rank_1.pt"))
    mf.write_manifest(path)  # a manifest that omits the file
    assert any("ftbridge_rank_1.pt" in p for p in CheckpointStore(str(tmp_path)).list()[0].problems())


def test_prune_keeps_last_k_and_removes_abandoned_staging(tmp_path):
    for step in (2, 4, 6, 8):
        make_checkpoint(tmp_path, step)
    make_checkpoint(tmp_path, 5, publish=False, quorum_id=3)
    make_checkpoint(tmp_path, 10, publish=False, quorum_id=3)  # may still be in progress: kept
    store = CheckpointStore(str(tmp_path))
    store.prune(keep=2)
    assert [c.step for c in store.list()] == [6, 8]
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith(".tmp-")) == [".tmp-global_step10-q3"]


def test_group_size_mismatch_names_both_sizes_and_conversion():
    with pytest.raises(GroupSizeMismatchError) as e:
        check_compatible({"group_size": 2, "zero_stage": 2}, "/c/global_step4", group_size=1, zero_stage=2)
    msg = str(e.value)
    assert "groups of 2 ranks" in msg and "has 1 ranks" in msg and "nothing was loaded" in msg
    assert "ds_to_universal" in msg and "--inject_missing_state" in msg and "--nproc-per-node 2" in msg
    with pytest.raises(GroupSizeMismatchError, match="ZeRO stage 2"):
        check_compatible({"group_size": 2, "zero_stage": 2}, "/c", group_size=2, zero_stage=3)
    check_compatible({"group_size": 2, "zero_stage": 1}, "/c", group_size=2, zero_stage=2)


def test_other_slots_are_refused_unless_allowed():
    meta = {"group_size": 1, "zero_stage": 2, "slots": 3}
    with pytest.raises(SlotsMismatchError) as e:
        check_compatible(meta, "/c/global_step4", group_size=1, zero_stage=2, slots=2)
    msg = str(e.value)
    assert "slots=3" in msg and "slots=2" in msg and "FTBRIDGE_SLOTS=3" in msg and "--resume-other-slots" in msg
    with pytest.raises(SlotsMismatchError, match="saved with slots=0"):  # saved before slots, or with them off
        check_compatible({"group_size": 1, "zero_stage": 2}, "/c", group_size=1, zero_stage=2, slots=2)
    check_compatible(meta, "/c", group_size=1, zero_stage=2, slots=3)
    check_compatible(meta, "/c", group_size=1, zero_stage=2, slots=None)  # allow_other_slots
    with pytest.raises(ValueError, match="slots -1 is not an integer"):
        check_metadata({**meta, "step": 4, "slots": -1}, "/c/ftbridge.json", 4)


# -- snapshot -------------------------------------------------------------------------------------
def _saved_bytes(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_snapshot_keeps_module_state_dict_metadata():
    sd = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2)).state_dict()
    snap = snapshot(sd)
    assert snap._metadata == sd._metadata
    assert _saved_bytes(snap) == _saved_bytes(sd)


def test_snapshot_preserves_sharing_bytes_and_is_isolated():
    flat = torch.arange(10, dtype=torch.float32)
    state = {"flat": flat, "views": [flat[:4], flat[4:].view(2, 3)], "step": 3, "meta": {"lr": 0.1}}
    snap = snapshot(state)
    assert _saved_bytes(snap) == _saved_bytes(state)
    assert snap["views"][0].untyped_storage().data_ptr() == snap["flat"].untyped_storage().data_ptr()
    flat.mul_(0)
    state["meta"]["lr"] = 9
    torch.testing.assert_close(snap["views"][1], torch.arange(4, 10, dtype=torch.float32).view(2, 3))
    assert snap["meta"]["lr"] == 0.1


def test_background_writer_runs_one_write_at_a_time():
    order = []
    w = BackgroundWriter()
    w.submit(lambda: order.append("first"))
    w.submit(lambda: order.append("second"))  # waits for the first
    w.wait()
    assert order == ["first", "second"]
    w.submit(lambda: 1 / 0)
    w.wait()
    assert isinstance(w.last_error, ZeroDivisionError)


# -- CLI ------------------------------------------------------------------------------------------
def test_cli_list_inspect_verify(tmp_path, capsys):
    make_checkpoint(tmp_path, 2)
    newest = make_checkpoint(tmp_path, 4)
    assert ckpt_cli(["list", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "global_step2" in out and "global_step4*" in out
    assert ckpt_cli(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "step         4" in out and "group size   2" in out and "zero_pp_rank_1" in out
    assert ckpt_cli(["verify", str(tmp_path)]) == 0
    with open(os.path.join(newest, "mp_rank_00_model_states.pt"), "ab") as f:
        f.write(b"x")
    capsys.readouterr()
    assert ckpt_cli(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "global_step2: OK" in out and "global_step4: BAD" in out and "mp_rank_00_model_states.pt" in out
    assert ckpt_cli(["list", str(tmp_path / "none")]) == 2


def test_hash_while_writing_matches_the_file(tmp_path):
    from ftbridge.checkpoint.async_save import write_state

    path = str(tmp_path / "x.pt")
    entry = write_state({"w": torch.randn(1000), "step": 3}, path)
    assert entry == {"bytes": os.path.getsize(path), "sha256": mf.sha256_file(path)}


def test_damaged_checkpoint_is_moved_aside_before_the_same_step_is_published_again(tmp_path):
    from ftbridge.checkpoint.group_io import _quarantine_if_bad

    good = make_checkpoint(tmp_path, 2)
    bad = make_checkpoint(tmp_path, 4)
    os.truncate(os.path.join(bad, "ftbridge_rank_0.pt"), 3)
    store = CheckpointStore(str(tmp_path))
    _quarantine_if_bad(store, "global_step2", logging.getLogger("t"))
    _quarantine_if_bad(store, "global_step4", logging.getLogger("t"))
    assert os.path.isdir(good) and not os.path.exists(bad)
    assert [n for n in os.listdir(tmp_path) if n.startswith(".bad-global_step4-")]


# -- SIGTERM when the step in flight cannot finish ----------------------------

def _checkpointer(tmp_path, grace_s):
    from types import SimpleNamespace

    from ftbridge.checkpoint.checkpointer import CheckpointConfig, Checkpointer
    from ftbridge.config import FTBridgeConfig

    hooks = []
    manager = SimpleNamespace(current_step=7, replica_rank=0)
    engine = SimpleNamespace(cfg=FTBridgeConfig.resolve({}), manager=manager, add_step_hook=hooks.append)
    cfg = CheckpointConfig(dir=str(tmp_path / "ckpt"), handle_sigterm=False, sigterm_grace_s=grace_s)
    return Checkpointer(engine, cfg)


def test_sigterm_exits_143_when_the_step_in_flight_does_not_finish(tmp_path, monkeypatch):
    # torchrun SIGTERMs a group's other ranks when one dies; their step can never finish, and the
    # group's rank 0 kept heartbeating until torchrun's SIGKILL 30 s later (chaos soak).
    import ftbridge.checkpoint.checkpointer as mod

    exited, codes = threading.Event(), []
    monkeypatch.setattr(mod.os, "_exit", lambda code: (codes.append(code), exited.set()))
    ck = _checkpointer(tmp_path, grace_s=0.2)
    ck._on_sigterm(signal.SIGTERM, None)
    assert exited.wait(timeout=10) and codes == [143]


def test_sigterm_grace_is_cancelled_once_the_step_finishes(tmp_path, monkeypatch):
    import ftbridge.checkpoint.checkpointer as mod

    codes = []
    monkeypatch.setattr(mod.os, "_exit", codes.append)
    ck = _checkpointer(tmp_path, grace_s=0.5)
    ck._on_sigterm(signal.SIGTERM, None)
    ck._after_step(committed=False)  # the step finished: stop in order, no forced exit
    ck._grace.join(timeout=10)
    assert ck.stopping and codes == []


def test_default_sigterm_grace_is_twice_the_cross_replica_timeout(tmp_path):
    assert _checkpointer(tmp_path, grace_s=None).sigterm_grace_s == 20.0
