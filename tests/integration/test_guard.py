"""The divergence guard finds a silent divergence and heals it, against a real lighthouse and torchft.

Replica group 1 triples its averaged gradient at step 3 (``--corrupt-sync-at``,
every collective still pairs, both groups commit: a silent divergence of the
kind a broken sync causes). With the guard every 4 steps, both groups write a
``divergence`` event for the state after step 4 (checked inside step 5), the
group that differs from the quorum's primary discards step 5 and heals from the
primary at the next step, and every step's parameter checksum agrees again from
then on, to the end. Without the guard, the groups end different:
the check can fail.
"""

from __future__ import annotations

import pytest

from tests.conftest import TINY

STEPS = 10


def _run(local_job, guard_every: int, action: str = "heal"):
    job = local_job(2, 1, [*TINY, "--steps", str(STEPS), "--corrupt-sync-at", "1:3"], min_replicas=2,
                    lighthouse_min_replicas=2,
                    env={"FTBRIDGE_GUARD_EVERY": str(guard_every), "FTBRIDGE_GUARD_ACTION": action})
    job.start()
    return job, job.wait(timeout_s=240)


def _checksums(job, step):
    return {g: next(e["param_checksum"] for e in job.steps(g) if e["step"] == step and e["committed"])
            for g in (0, 1) if any(e["step"] == step and e["committed"] for e in job.steps(g))}


@pytest.mark.timeout(400)
def test_guard_heals_a_silent_divergence(local_job):
    job, codes = _run(local_job, 4)
    assert codes == {0: 0, 1: 0}, job.tails()
    assert len(set(_checksums(job, 3).values())) == 2, "the corruption did not make the groups differ"
    found = [e for e in job.events() if e.get("event") == "divergence"]
    assert {(e["replica_group"], e["step"]) for e in found} == {(0, 4), (1, 4)}, found
    differing = found[0]["differing_groups"]
    assert len(differing) == 1 and differing[0] != found[0]["primary_group"]
    # The differing group discards step 5 (the primary commits it), then heals from the primary at the
    # next step (with min_replicas=2 that step commits nowhere: only the primary participates).
    primary, other = found[0]["primary_group"], differing[0]
    assert [e["committed"] for e in job.steps(primary) if e["step"] == 5] == [True, False]
    assert not any(e["committed"] for e in job.steps(other) if e["step"] == 5)
    healed = [e for e in job.steps(other) if e["healed"]]
    assert len(healed) == 1 and healed[0]["step"] == 5, job.steps(other)
    assert healed[0]["param_checksum"] == _checksums(job, 5)[primary]
    for step in range(6, STEPS + 1):
        assert len(set(_checksums(job, step).values())) == 1, f"groups differ at step {step}"
    finals = {e["replica_group"]: e for e in job.events() if e.get("event") == "final"}
    assert finals[0]["param_checksum"] == finals[1]["param_checksum"]
    assert finals[0]["optimizer_checksum"] == finals[1]["optimizer_checksum"]
    assert finals[0]["guard_checks"] == 2 and finals[0]["guard_mismatches"] == 1


@pytest.mark.timeout(400)
def test_without_the_guard_the_divergence_stays(local_job):
    job, codes = _run(local_job, 0)
    assert codes == {0: 0, 1: 0}, job.tails()
    assert not [e for e in job.events() if e.get("event") == "divergence"]
    finals = {e["replica_group"]: e for e in job.events() if e.get("event") == "final"}
    assert finals[0]["param_checksum"] != finals[1]["param_checksum"]


@pytest.mark.timeout(400)
def test_guard_stop_ends_every_group_with_an_error(local_job):
    job, codes = _run(local_job, 4, action="stop")
    assert codes[0] != 0 and codes[1] != 0, job.tails()
    assert "ReplicaDivergenceError" in job.log_text(0) and "ReplicaDivergenceError" in job.log_text(1)
    assert max(e["step"] for e in job.steps(0) if e["committed"]) == 4   # stopped inside step 5
