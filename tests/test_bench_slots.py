"""The slots benchmark's pure part: step times before and after a kill (ftbridge.harness.bench.slots)."""

import pytest

from ftbridge.harness.bench.slots import IDEAL, phase_step_times


def step(t, step_time, participants=2, committed=True):
    return {"time": t, "committed": committed, "participants": participants, "step_time_s": step_time}


def test_full_and_degraded_medians_leave_out_warmup_and_the_stall():
    records = [step(1, 9.0), step(2, 1.0), step(3, 1.2), step(4, 1.1),            # warm-up 9.0 left out
               step(10.5, 5.0, participants=1), step(11, 2.0, participants=1),  # the stall left out
               step(12, 2.2, participants=1), step(12.5, 7.0, participants=1, committed=False),
               step(13, 2.1, participants=1)]
    assert phase_step_times(records, kill_time=10.0, warmup=1) == {"full_s": 1.1, "degraded_s": 2.1}
    assert IDEAL == 2.0


def test_a_run_without_degraded_steps_is_named():
    with pytest.raises(ValueError, match="0 degraded steps"):
        phase_step_times([step(1, 1.0), step(2, 1.0), step(11, 3.0, participants=1)], kill_time=10.0, warmup=0)
