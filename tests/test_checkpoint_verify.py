"""Hostile and careless checkpoint folders: verify, metadata bounds, pruning, leftovers, ``ftbridge-ckpt`` (issue 17).

Each case is what a reviewer did to a published checkpoint; each must end in a
named problem (or a clear CLI error with exit 2), fast, without reading
outside the folder, following a link, or blocking on a FIFO.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

import pytest

from ftbridge.checkpoint import manifest as mf
from ftbridge.checkpoint.cli import main as ckpt_cli
from ftbridge.checkpoint.store import STALE_TMP_S, CheckpointInfo, CheckpointStore, NoValidCheckpointError
from tests.test_checkpoint import make_checkpoint

SHARD = "zero_pp_rank_1_mp_rank_00_optim_states.pt"


def _info(path):
    return CheckpointInfo(os.path.basename(path), int(os.path.basename(path)[len("global_step"):]), path)


def _rewrite_manifest(path, edit):
    """Apply ``edit`` to the manifest's JSON and write it back (what an attacker with write access does)."""
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    edit(manifest)
    manifest["total_bytes"] = sum(f["bytes"] for f in manifest["files"].values())
    mf.write_json_atomic(os.path.join(path, "manifest.json"), manifest)


def test_file_missing_from_the_manifest_is_reported(tmp_path):
    # A model-states file truncated to 10 bytes, its entry removed from the manifest, used to pass.
    path = make_checkpoint(tmp_path, 2)
    os.truncate(os.path.join(path, "mp_rank_00_model_states.pt"), 10)
    _rewrite_manifest(path, lambda m: m["files"].pop("mp_rank_00_model_states.pt"))
    problems = _info(path).problems()
    assert any("mp_rank_00_model_states.pt: not in the manifest" in p for p in problems), problems


@pytest.mark.parametrize("outside", ["../../outside.bin", "/etc/hostname", "./ftbridge.json", "a//b"])
def test_manifest_paths_outside_the_folder_are_refused_unread(tmp_path, outside):
    path = make_checkpoint(tmp_path / "root", 2)
    target = tmp_path / "outside.bin"
    target.write_bytes(b"secret" * 7)
    entry = {"bytes": 42, "sha256": hashlib.sha256(b"secret" * 7).hexdigest()}  # the right hash: used to pass
    _rewrite_manifest(path, lambda m: m["files"].__setitem__(outside, entry))
    problems = _info(path).problems()
    assert len(problems) == 1 and "leaves the checkpoint folder or is not normalised" in problems[0], problems
    assert "42 bytes" not in problems[0]  # nothing about the outside file is revealed


def test_symlinks_are_reported_not_followed(tmp_path):
    path = make_checkpoint(tmp_path / "root", 2)
    shard = os.path.join(path, SHARD)
    real = tmp_path / "real_shard.pt"
    os.rename(shard, real)
    os.symlink(real, shard)  # same bytes, same hash: used to pass
    problems = _info(path).problems()
    assert any(f"{shard}: symbolic link" in p for p in problems), problems
    # A checkpoint folder that is itself a link is refused too.
    os.symlink(path, tmp_path / "root" / "global_step9")
    assert "not a folder (or a symbolic link" in _info(str(tmp_path / "root" / "global_step9")).problems()[0]


def test_fifo_and_device_in_the_folder_never_block(tmp_path):
    path = make_checkpoint(tmp_path, 2)
    os.mkfifo(os.path.join(path, "extra.fifo"))
    os.remove(os.path.join(path, "manifest.json"))
    os.mkfifo(os.path.join(path, "manifest.json"))  # open() of a FIFO for reading blocks without a writer
    t = time.monotonic()
    problems = _info(path).problems()
    assert time.monotonic() - t < 5 and "not a regular file" in problems[0], problems


def test_renamed_checkpoint_folder_is_refused(tmp_path):
    path = make_checkpoint(tmp_path, 6)
    os.rename(path, tmp_path / "global_step8")  # manifest and metadata say step 6: used to pass
    problems = _info(str(tmp_path / "global_step8")).problems()
    assert len(problems) == 1 and "folder is step 8" in problems[0] and "step 6" in problems[0], problems


@pytest.mark.parametrize("missing", ["mp_rank_00_model_states.pt", SHARD])
def test_deepspeed_file_set_of_the_group_size_is_required(tmp_path, missing):
    path = make_checkpoint(tmp_path, 2)
    os.remove(os.path.join(path, missing))
    mf.write_manifest(path, {"tag": "global_step2", "step": 2})  # a consistent manifest without the file
    problems = _info(path).problems()
    assert problems and ("rank 1" in problems[0] or missing in problems[0]), problems


def _set_metadata(path, **fields):
    meta_path = os.path.join(path, "ftbridge.json")
    text = open(meta_path).read()
    for key, raw in fields.items():
        meta = json.loads(text)
        text = text.replace(f'"{key}": {json.dumps(meta[key])}', f'"{key}": {raw}')
    with open(meta_path, "w") as f:
        f.write(text)
    mf.write_manifest(path, {"tag": os.path.basename(path), "step": int(os.path.basename(path)[11:])})


@pytest.mark.parametrize("raw, expect", [("100000000", "group_size 100000000 is not an integer between 1 and"),
                                         ("1e309", "1e309 overflows a float"),
                                         ("NaN", "NaN is not a number JSON allows"),
                                         ('"2"', "group_size '2' is not an integer"),
                                         ("true", "group_size True is not an integer")])
def test_metadata_is_bounded_and_fails_fast(tmp_path, raw, expect):
    # group_size 100000000 made verify and resume run 26 s and reach 6.1 GB; 1e309 crashed with a traceback.
    path = make_checkpoint(tmp_path, 2)
    _set_metadata(path, group_size=raw)
    t = time.monotonic()
    problems = _info(path).problems()
    assert time.monotonic() - t < 2
    assert len(problems) == 1 and expect in problems[0], problems
    with pytest.raises(NoValidCheckpointError, match="no valid checkpoint"):
        CheckpointStore(str(tmp_path)).find_valid()


def test_metadata_is_hashed_before_it_is_parsed(tmp_path):
    path = make_checkpoint(tmp_path, 2)
    with open(os.path.join(path, "ftbridge.json"), "w") as f:
        f.write('{"group_size": 1e309}')  # altered after the manifest: never parsed
    with pytest.raises(ValueError, match="SHA-256 differs"):
        _info(path).metadata()


@pytest.mark.parametrize("manifest", ['{"files": []}', '{"files": {"x": {"bytes": -1, "sha256": "0"}}}',
                                      "[" * 100000, '{"files": {}, "total_bytes": 1e309}'])
def test_wrong_shaped_manifest_is_a_problem_not_a_crash(tmp_path, manifest):
    path = make_checkpoint(tmp_path, 2)
    with open(os.path.join(path, "manifest.json"), "w") as f:
        f.write(manifest)
    problems = _info(path).problems()
    assert len(problems) == 1 and "unreadable manifest" in problems[0], problems


def test_prune_never_deletes_latest_or_newest_verified(tmp_path):
    # keep=1 with a damaged newest checkpoint deleted the valid one that latest named; resume then failed.
    for step in (2, 4, 6, 8):
        make_checkpoint(tmp_path, step)
    os.truncate(tmp_path / "global_step8" / SHARD, 10)
    mf.update_latest(str(tmp_path), "global_step6")
    store = CheckpointStore(str(tmp_path))
    store.prune(keep=1)
    assert [c.step for c in store.list()] == [6, 8]
    assert store.find_valid().tag == "global_step6"


def test_prune_keeps_newest_verified_when_latest_is_damaged(tmp_path):
    for step in (2, 4, 6):
        make_checkpoint(tmp_path, step)
    for step in (4, 6):
        os.truncate(tmp_path / f"global_step{step}" / SHARD, 10)
    mf.update_latest(str(tmp_path), "global_step4")
    store = CheckpointStore(str(tmp_path))
    store.prune(keep=1)
    assert [c.step for c in store.list()] == [2, 4, 6]
    assert store.find_valid().tag == "global_step2"


def test_prune_removes_quarantined_and_stale_latest_tmp_only(tmp_path):
    make_checkpoint(tmp_path, 2)
    make_checkpoint(tmp_path, 4)
    (tmp_path / ".bad-global_step4-123").mkdir()  # moved aside before step 4 was published again
    (tmp_path / ".bad-global_step6-124").mkdir()  # newer than any checkpoint: kept
    for name, age in (("latest.tmp555", STALE_TMP_S + 10), ("latest.tmp556", 0)):  # killed writer / live one
        (tmp_path / name).write_text("global_step4")
        os.utime(tmp_path / name, (time.time() - age, time.time() - age))
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / ".bad-global_step2-9")  # a link is never followed or removed
    (tmp_path / ".bad-notes").write_text("user file")
    CheckpointStore(str(tmp_path)).prune(keep=0)
    left = sorted(n for n in os.listdir(tmp_path) if n.startswith((".bad", "latest")))
    assert left == [".bad-global_step2-9", ".bad-global_step6-124", ".bad-notes", "latest", "latest.tmp556"]
    assert (tmp_path / "elsewhere").is_dir()


# -- ftbridge-ckpt ------------------------------------------------------------------------------------
def test_cli_missing_folder_and_not_a_folder_exit_2(tmp_path, capsys):
    assert ckpt_cli(["list", str(tmp_path / "none")]) == 2
    assert "no such folder" in capsys.readouterr().err
    assert ckpt_cli(["verify", "/dev/zero"]) == 2
    assert "not a folder" in capsys.readouterr().err
    assert ckpt_cli(["list", str(tmp_path)]) == 2  # an existing, empty folder: nothing to show
    assert "no checkpoints in" in capsys.readouterr().err


@pytest.mark.timeout(30)
@pytest.mark.parametrize("damage", ["wrong_shape", "fifo", "dev_zero"])
def test_cli_wrong_shaped_json_fifo_and_dev_zero_are_clear_errors(tmp_path, capsys, damage):
    path = make_checkpoint(tmp_path, 2)
    meta = os.path.join(path, "ftbridge.json")
    os.remove(meta)
    if damage == "wrong_shape":
        with open(meta, "w") as f:
            f.write("[1, 2]")
        mf.write_manifest(path, {"tag": "global_step2", "step": 2})
    elif damage == "fifo":
        os.mkfifo(meta)
    else:
        os.symlink("/dev/zero", meta)
    for cmd, code in (("list", 2), ("inspect", 2), ("verify", 1)):
        assert ckpt_cli([cmd, str(tmp_path)]) == code, cmd
        out = capsys.readouterr()
        assert "Traceback" not in out.err + out.out
        assert "ftbridge.json" in out.err + out.out, (cmd, out)


class _CreatesFile:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):  # unpickling calls open(path, "w")
        return (open, (self.path, "w"))


def test_cli_verify_reports_a_file_that_would_run_code(tmp_path, capsys):
    # The crafted file with a regenerated manifest used to pass verify.
    import torch

    path = make_checkpoint(tmp_path / "root", 2)
    marker = tmp_path / "pwned"
    torch.save({"micro_steps": 1, "extra": _CreatesFile(str(marker))}, os.path.join(path, "ftbridge_rank_1.pt"))
    mf.write_manifest(path, {"tag": "global_step2", "step": 2})
    assert _info(path).problems() == []  # the hashes match: only the safe loader can tell
    assert ckpt_cli(["verify", str(tmp_path / "root")]) == 1
    out = capsys.readouterr().out
    assert "global_step2: BAD" in out and "ftbridge_rank_1.pt: it needs type io.open" in out, out
    assert not marker.exists()


def test_keyed_hmac_detects_a_regenerated_manifest(tmp_path):
    from ftbridge.checkpoint.store import load_key

    key_file = tmp_path / "key"
    key_file.write_text("k" * 32)
    key = load_key(str(key_file), str(tmp_path / "root"))
    path = make_checkpoint(tmp_path / "root", 2)
    mf.write_manifest(path, {"tag": "global_step2", "step": 2}, key=key)  # what the writer does with a key
    signed = CheckpointStore(str(tmp_path / "root"), key)
    assert signed.list()[0].problems() == []
    with open(os.path.join(path, "mp_rank_00_model_states.pt"), "ab") as f:
        f.write(b"other weights")
    mf.write_manifest(path, {"tag": "global_step2", "step": 2})  # regenerated by someone without the key
    assert _info(path).problems() == []  # without a key this cannot be told apart
    problems = signed.list()[0].problems()
    assert len(problems) == 1 and "HMAC does not match the checkpoint key" in problems[0], problems
    os.remove(os.path.join(path, "manifest.hmac"))
    assert "missing or unreadable" in signed.list()[0].problems()[0]
    with pytest.raises(ValueError, match="lies inside the checkpoint folder"):
        load_key(str(tmp_path / "root" / "key"), str(tmp_path / "root"))
    (tmp_path / "short").write_text("abc")
    with pytest.raises(ValueError, match="use at least 16 random bytes"):
        load_key(str(tmp_path / "short"), str(tmp_path / "root"))
    (tmp_path / "keys").mkdir()
    with pytest.raises(ValueError, match="keys is a folder; give the path of the file"):
        load_key(str(tmp_path / "keys"), str(tmp_path / "root"))
    with pytest.raises(ValueError, match="nokey is missing"):
        load_key(str(tmp_path / "nokey"), str(tmp_path / "root"))
