"""The divergence guard finds a silent divergence and repairs it by majority, against a real lighthouse and torchft.

A replica group triples its averaged gradient at step 3 (``--corrupt-sync-at``; every collective still
pairs and every group commits: a silent divergence of the kind a broken sync causes). With the guard every
4 steps, the state after step 4 is compared inside step 5:

* three groups, the corrupted one the quorum's primary (group 0, replica rank 0): the two others hold the
  majority's state; group 0 discards step 5 and heals from one of them, and every group agrees from then
  on. The primary is not the reference (it once was, and the healthy groups healed from the corrupted one);
* two groups: no state is held by a majority, nobody can be named right, and both groups stop by default.
"""

from __future__ import annotations

import pytest

from tests.conftest import TINY

STEPS = 10


def _run(local_job, groups: int, corrupt: str, guard_every: int, action: str = "heal"):
    # max_restarts=0: a group the guard stops stays stopped (restarted, it would wait for a peer to heal from)
    job = local_job(groups, 1, [*TINY, "--steps", str(STEPS), "--corrupt-sync-at", corrupt], min_replicas=2,
                    max_restarts=0, lighthouse_min_replicas=groups,
                    env={"FTBRIDGE_GUARD_EVERY": str(guard_every), "FTBRIDGE_GUARD_ACTION": action})
    job.start()
    return job, job.wait(timeout_s=240)


def _checksums(job, step, groups):
    return {g: next(e["param_checksum"] for e in job.steps(g) if e["step"] == step and e["committed"])
            for g in groups if any(e["step"] == step and e["committed"] for e in job.steps(g))}


@pytest.mark.timeout(400)
def test_the_majority_heals_a_corrupted_primary(local_job):
    job, codes = _run(local_job, 3, "0:3", 4)
    assert codes == {0: 0, 1: 0, 2: 0}, job.tails()
    assert len(set(_checksums(job, 3, (0, 1, 2)).values())) == 2, "the corruption did not make group 0 differ"
    found = [e for e in job.events() if e.get("event") == "divergence"]
    assert {(e["replica_group"], e["step"]) for e in found} == {(0, 4), (1, 4), (2, 4)}, found
    assert all(e["differing_groups"] == [0] and e["majority_groups"] == [1, 2] and not e["tie"] for e in found)
    assert {e["replica_group"]: e["action"] for e in found} == {0: "heal", 1: "go on", 2: "go on"}
    # Group 0 discards step 5 while the majority commits it, then heals from a group of the majority.
    assert not any(e["committed"] for e in job.steps(0) if e["step"] == 5)
    healed = [e for e in job.steps(0) if e["healed"]]
    assert len(healed) == 1 and healed[0]["heal_source"] in (1, 2), job.steps(0)
    for step in range(6, STEPS + 1):
        assert len(set(_checksums(job, step, (0, 1, 2)).values())) == 1, f"groups differ at step {step}"
    finals = {e["replica_group"]: e for e in job.events() if e.get("event") == "final"}
    assert len({f["param_checksum"] for f in finals.values()}) == 1
    assert len({f["optimizer_checksum"] for f in finals.values()}) == 1
    # The healthy groups never took the corrupted state: their step-3 checksum is the healthy lineage's.
    assert finals[1]["guard_checks"] == 2 and finals[1]["guard_mismatches"] == 1


@pytest.mark.timeout(400)
def test_two_groups_that_differ_stop_rather_than_copy_either(local_job):
    job, codes = _run(local_job, 2, "1:3", 4)
    assert codes[0] != 0 and codes[1] != 0, job.tails()
    for g in (0, 1):
        assert "ReplicaDivergenceError" in job.log_text(g) and "none can be named right" in job.log_text(g)
    found = [e for e in job.events() if e.get("event") == "divergence"]
    assert {e["replica_group"] for e in found} == {0, 1} and all(e["tie"] and e["action"] == "stop" for e in found)
    assert max(e["step"] for e in job.steps(0) if e["committed"]) == 4   # stopped inside step 5
    assert not any(e["healed"] for g in (0, 1) for e in job.steps(g))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_without_the_guard_the_divergence_stays(local_job):
    job, codes = _run(local_job, 2, "1:3", 0)
    assert codes == {0: 0, 1: 0}, job.tails()
    assert not [e for e in job.events() if e.get("event") == "divergence"]
    finals = {e["replica_group"]: e for e in job.events() if e.get("event") == "final"}
    assert finals[0]["param_checksum"] != finals[1]["param_checksum"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_guard_action_stop_ends_every_group_even_with_a_majority(local_job):
    job, codes = _run(local_job, 3, "1:3", 4, action="stop")
    assert all(c != 0 for c in codes.values()), job.tails()
    assert all("ReplicaDivergenceError" in job.log_text(g) for g in (0, 1, 2))
    assert max(e["step"] for e in job.steps(0) if e["committed"]) == 4
