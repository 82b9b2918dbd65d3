"""Failures during a heal: the joiner applies nothing partial, commits nothing, and heals again.

Three replica groups x 2 ranks. Groups 0 and 1 train; group 2 joins and heals.
The fault point ``heal_send`` (:mod:`ftbridge.faults`) kills the donor rank
half-way through sending its state, so the two ranks of the joiner disagree
(one received its state, the other did not). Neither may apply it
(:mod:`ftbridge.heal`): the step is discarded on every replica, and the next
quorum heals the joiner from the group that is still healthy.
"""

from __future__ import annotations

import os
import time

import pytest

from ftbridge import faults
from tests.conftest import TINY


@pytest.mark.slow  # CI covers it through test_chaos_run.py (kill_donor_in_heal); this one asserts more, -m slow
@pytest.mark.timeout(420)
def test_donor_killed_mid_transfer_joiner_heals_from_another_group(local_job, tmp_path):
    fault_dir = str(tmp_path / "faults")
    job = local_job(3, 2, [*TINY, "--steps", "100000"], max_restarts=2, env={faults.ENV_DIR: fault_dir})
    job.script_args += ["--stop-file", f"{job.workdir}/stop"]
    job.start(groups=[0, 1])
    job.wait_until(lambda: any(e["committed"] and e["participants"] == 2 for e in job.steps(0)), 120,
                   "groups 0 and 1 to commit together")
    faults.arm(fault_dir, "heal_send")
    t_join = time.time()
    job.start_group(2)
    job.wait_until(lambda: faults.fired(fault_dir, "heal_send"), 120, "the donor to die mid-transfer")
    with open(os.path.join(fault_dir, "heal_send.fired"), encoding="utf-8") as f:
        donor = int(f.read().split("replica_group=")[1].split()[0])
    assert donor in (0, 1)
    job.wait_until(lambda: any(e["healed"] and e["committed"] for e in job.steps(2)), 180, "group 2 to heal")
    # torchrun restarts the donor's group, which heals too: end the run only once it is back.
    job.wait_heal(donor, t_join, 180, f"the donor's group {donor} to restart and heal")

    target = job.stop_soon(5)
    codes = job.wait(timeout_s=240)
    assert codes == {0: 0, 1: 0, 2: 0}, job.tails()

    # The joiner: nothing committed before its first heal; that heal applied on both ranks in the same step.
    for r in (0, 1):
        recs = job.steps(2, r)
        first_heal = next(i for i, e in enumerate(recs) if e["healed"])
        assert not any(e["committed"] for e in recs[:first_heal]), recs[:first_heal + 1]
        assert first_heal >= 1, f"group 2 rank {r} healed at once: the broken transfer was not noticed"
    assert [e["step"] for e in job.steps(2, 0) if e["healed"]] == [e["step"] for e in job.steps(2, 1) if e["healed"]]
    # The healthy group did not heal again; the joiner's first healed step matches it bit for bit.
    healthy = 1 - donor
    assert not job.healed_since(healthy, t_join)
    by_step = {e["step"]: e["param_checksum"] for e in job.steps(healthy) if e["committed"]}
    first = next(e for e in job.steps(2) if e["healed"] and e["committed"])
    assert first["param_checksum"] == by_step[first["step"]]
    finals = [e for e in job.events() if e.get("event") == "final"]
    assert len(finals) == 6 and {f["step"] for f in finals} == {target}
    assert len({f["param_checksum"] for f in finals}) == 1, finals
