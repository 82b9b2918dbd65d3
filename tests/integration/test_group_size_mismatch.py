"""A job whose replica groups have different numbers of ranks: the odd group is refused, the others train on.

Real lighthouse, real ``ftbridge-run`` per group (TINY model): group 0 (the
quorum's primary, replica rank 0) has 1 rank, group 1 has 2. ZeRO partitions
and heal state are shaped by the group size, so group 1 must never all-reduce,
heal or commit with group 0; it must stop with an error naming both sizes and
the fix, and group 0 must finish its run alone.
"""

from __future__ import annotations

import pytest

from tests.conftest import TINY


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_group_of_another_size_is_refused_and_the_primary_trains_on(local_job):
    job = local_job(2, 1, [*TINY, "--steps", "100000"], group_sizes={1: 2}, max_restarts=0)
    job.start(groups=[0])
    job.wait_step(0, 2, timeout_s=120)  # group 0 is in the quorum first: replica rank 0, the reference size
    job.start_group(1)
    code = job.wait(timeout_s=120, groups=[1])[1]
    log = job.log_text(1)
    assert code != 0, job.tails()
    assert "this replica group has 2 ranks but the quorum's primary group has 1" in log, job.tails()
    assert "GroupSizeMismatch" in log
    assert job.steps(1, 0) == [] and job.steps(1, 1) == [], "the odd group trained, healed or committed"
    refused_at = max(e["step"] for e in job.steps(0) if e["committed"])
    job.wait_step(0, refused_at + 5, timeout_s=60)  # the primary trains on alone
    assert job.groups[0][-1].proc.poll() is None, job.tails()
    job.stop_group(0)
    steps = job.steps(0)
    assert not any(e.get("healed") for e in steps), "group 0 healed from a group of another size"
    assert {e["participants"] for e in steps if e["committed"]} == {1}, "group 0 committed with the odd group"
