"""A warm spare takes a killed group's place: 2 active groups x 1 rank + 1 spare, tiny model.

The spare starts once both groups commit together and stands by; group 1 is
SIGKILLed (its launcher has no restarts: the spare is the restart). The
spare must take over group 1's id, heal, and train; at the end the survivor
and the spare hold the same parameters and optimizer state, the spare read
exactly group 1's data shard (what a cold restart of group 1 reads), and no
process of the job is left.
"""

from __future__ import annotations

import time

import pytest

from ftbridge.data import ShardedTextData, load_text
from ftbridge.events import tensor_checksum
from ftbridge.local_job import pid_alive
from tests.conftest import TINY


def _expected_input_checksum(data: ShardedTextData, step: int, micro: int) -> str:
    x, _ = data.get_batch(step, micro, dp_rank=1, dp_world_size=2)  # group 1's rows of 2 groups x 1 rank
    return tensor_checksum([x])


@pytest.mark.timeout(240)
def test_spare_replaces_a_killed_group(local_job):
    job = local_job(2, 1, [*TINY, "--steps", "100000", "--log-batches"], max_restarts=0,
                    env={"OMP_NUM_THREADS": "1"})
    job.script_args += ["--stop-file", f"{job.workdir}/stop"]
    job.start()
    job.start_spare(0)
    job.wait_until(lambda: job.spare_ready(0), 120, "spare 0 to stand by")
    job.wait_until(lambda: all(any(e["committed"] and e["participants"] == 2 for e in job.steps(g)) for g in (0, 1)),
                   120, "both groups to commit together")
    assert not any(e.get("event") == "spare_join" for e in job.events()), "the spare joined a full job"

    kill_time = time.time()
    killed = job.kill_workers(1)
    job.wait_until(lambda: any(e.get("event") == "spare_join" for e in job.events(1)), 60, "the spare to join")
    job.wait_heal(1, kill_time, 60, "the spare to heal as group 1")
    job.wait_until(lambda: any(e["committed"] and e["participants"] == 2 and e["time"] > kill_time
                               and not e["healed"] for e in job.steps(1)), 60, "the spare to train with group 0")
    target = job.max_step() + 3
    job.write_file("stop", str(target))
    assert job.wait(timeout_s=120, groups=[0]) == {0: 0}, job.tails()
    assert job.wait_spare(0, 120) == 0, job.tails()

    join = next(e for e in job.events(1) if e.get("event") == "spare_join")
    assert join["replaces"] == 1 and join["time"] > kill_time
    finals = {g: [e for e in job.events(g) if e.get("event") == "final"][-1] for g in (0, 1)}
    spare_pid = [e["pid"] for e in job.events(1) if e.get("event") == "start"][-1]
    assert spare_pid not in killed
    assert finals[0]["step"] == finals[1]["step"] == target
    assert finals[0]["param_checksum"] == finals[1]["param_checksum"]
    assert finals[0]["optimizer_checksum"] == finals[1]["optimizer_checksum"]
    assert finals[1]["heals"] >= 1

    data = ShardedTextData(load_text(), context=32, micro_batch=4, seed=1234)
    spare_batches = [e for e in job.events(1) if e.get("event") == "batch" and e["time"] > join["time"]]
    assert spare_batches, "the spare logged no batch"
    for e in spare_batches:
        assert (e["dp_rank"], e["dp_world_size"]) == (1, 2), e
        assert e["input_checksum"] == _expected_input_checksum(data, e["step"], e["micro_step"]), e

    job.stop()
    assert not [p for p in job.all_worker_pids() if pid_alive(p)]
