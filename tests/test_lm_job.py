"""The main job's settings: slots on by default in scripts/train_lm.py, off in the test harness unless asked."""

from __future__ import annotations

import pytest

from ftbridge.harness import lm_job
from ftbridge.harness.local_job import LocalJob


def _args(*argv):
    return lm_job.build_parser().parse_args(list(argv))


@pytest.mark.parametrize("environ, want", [
    ({"FTBRIDGE_NUM_REPLICA_GROUPS": "3"}, 3),   # unset: one slot per planned group
    ({"FTBRIDGE_NUM_REPLICA_GROUPS": "3", "FTBRIDGE_SLOTS": ""}, 3),
    ({"FTBRIDGE_NUM_REPLICA_GROUPS": "3", "FTBRIDGE_SLOTS": "0"}, 0),  # ftbridge-run --slots 0
    ({"FTBRIDGE_NUM_REPLICA_GROUPS": "3", "FTBRIDGE_SLOTS": "5"}, 5),
    ({}, 1),
])
def test_main_job_trains_with_one_slot_per_group_unless_told(environ, want):
    cfg = lm_job.ft_config(_args("--sync-mode", "post_backward"), environ)
    assert cfg.slots == want
    assert cfg.sync_mode == "post_backward", "the script's flags still reach the config"


def test_main_job_names_a_bad_slot_count():
    with pytest.raises(ValueError, match="slots=2 .*fewer than num_replica_groups=3"):
        lm_job.ft_config(_args(), {"FTBRIDGE_NUM_REPLICA_GROUPS": "3", "FTBRIDGE_SLOTS": "2"})


def test_local_job_runs_slots_off_unless_asked(tmp_path, monkeypatch):
    monkeypatch.delenv("FTBRIDGE_SLOTS", raising=False)
    assert LocalJob(str(tmp_path / "a"), 2, 1, []).env["FTBRIDGE_SLOTS"] == "0"
    assert LocalJob(str(tmp_path / "b"), 2, 1, [], env={"FTBRIDGE_SLOTS": "2"}).env["FTBRIDGE_SLOTS"] == "2"
    monkeypatch.setenv("FTBRIDGE_SLOTS", "2")
    assert "FTBRIDGE_SLOTS" not in LocalJob(str(tmp_path / "c"), 2, 1, []).env, "the caller's environment stands"
