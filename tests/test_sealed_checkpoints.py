"""Sealed Hugging Face checkpoints (:mod:`ftbridge.integrations.sealed_checkpoints`), on files only: a resume
takes the newest folder whose files match its manifest, whatever newer folder a killed writer left."""

from __future__ import annotations

import logging
import os

import pytest

from ftbridge.integrations import sealed_checkpoints as tc

pytestmark = pytest.mark.timeout(60)


def _checkpoint(root, step, sealed=True, size=64):
    path = root / f"checkpoint-{step}"
    (path / "global_step").mkdir(parents=True)
    (path / "model.safetensors").write_bytes(bytes(range(size % 256)) * 3)
    (path / "global_step" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x" * size)
    (path / "trainer_state.json").write_text('{"global_step": %d}' % step)
    if sealed:
        tc.seal(str(path))
    return str(path)


def test_the_newest_whole_checkpoint_is_taken_and_each_newer_one_skipped_is_named(tmp_path, caplog):
    _checkpoint(tmp_path, 5)
    whole = _checkpoint(tmp_path, 10)
    truncated = _checkpoint(tmp_path, 20)
    os.truncate(os.path.join(truncated, "model.safetensors"), 10)
    unsealed = _checkpoint(tmp_path, 30, sealed=False)
    (tmp_path / "checkpoint-40").write_text("a file, not a folder")
    (tmp_path / "runs").mkdir()
    with caplog.at_level(logging.WARNING):
        assert tc.latest_sealed(str(tmp_path)) == whole
    text = caplog.text
    assert unsealed in text and "manifest" in text and truncated in text and "truncated or altered" in text
    assert tc.resume_path(True, str(tmp_path)) == whole
    assert [s for s, _ in tc.checkpoints(str(tmp_path))] == [30, 20, 10, 5]


def test_a_file_added_or_altered_after_sealing_unseals_the_checkpoint(tmp_path):
    added = _checkpoint(tmp_path, 1)
    (tmp_path / "checkpoint-1" / "extra.bin").write_bytes(b"?")
    altered = _checkpoint(tmp_path, 2)
    with open(os.path.join(altered, "trainer_state.json"), "r+b") as f:
        f.write(b"[")
    assert "not in the manifest" in " ".join(tc.problems(added))
    assert "SHA-256" in " ".join(tc.problems(altered))
    assert tc.latest_sealed(str(tmp_path)) is None


def test_resume_from_nothing_whole_or_from_a_broken_folder_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ValueError, match="no whole checkpoint in .*resume from a folder by name"):
        tc.resume_path(True, str(tmp_path))
    with pytest.raises(ValueError, match="no whole checkpoint"):
        tc.resume_path(True, str(tmp_path / "missing"))
    broken = _checkpoint(tmp_path, 3)
    os.remove(os.path.join(broken, "trainer_state.json"))
    with pytest.raises(ValueError, match=r"checkpoint-3.*does not match its manifest.*trainer_state.json: missing"):
        tc.resume_path(broken, str(tmp_path))
    plain = _checkpoint(tmp_path, 4, sealed=False)  # a plain Trainer's: taken as given, by name only
    assert tc.resume_path(plain, str(tmp_path)) == plain
    assert tc.resume_path(None, str(tmp_path)) is None and tc.resume_path(False, str(tmp_path)) is False


def test_accelerates_folder_names_are_read_with_their_pattern(tmp_path):
    for step in (1, 2):
        path = tmp_path / f"checkpoint_{step}"
        path.mkdir()
        (path / "random_states_0.pkl").write_bytes(b"r" * step)
        tc.seal(str(path))
    os.truncate(tmp_path / "checkpoint_2" / "random_states_0.pkl", 0)
    assert tc.latest_sealed(str(tmp_path)) is None, "the Trainer's pattern does not match Accelerate's names"
    assert tc.latest_sealed(str(tmp_path), tc.ACCELERATE) == str(tmp_path / "checkpoint_1")
