"""Run a Hugging Face worker script as a fault-tolerant job of 2 replica groups and as plain DeepSpeed on the
same number of ranks, side by side: the equivalence tests of the Accelerate and Trainer integrations."""

from __future__ import annotations

import torch

from ftbridge.harness import local_job as local_job_module


def run_ft_and_plain(local_job, tmp_path, worker, extra=(), group_size=1, env=None):
    """Start the fault-tolerant job (2 groups of ``group_size``), run the plain one (2 x group_size ranks)
    meanwhile, wait for both (240 s each).

    Args:
        local_job: the ``local_job`` fixture; worker: the script both run, with ``--out DIR`` and ``extra``.
        env: more environment for the fault-tolerant job's ranks (``OMP_NUM_THREADS=1`` always).

    Returns:
        ``(ft, plain)``: each run's ``result_{rank}.pt``, indexed by data-parallel rank.

    Raises:
        AssertionError: either run failed (the processes' last lines in the message).
    """
    ft_out, plain_out = tmp_path / "ft", tmp_path / "plain"
    job = local_job(2, group_size, ["--out", str(ft_out), *extra], script=worker, min_replicas=2,
                    lighthouse_min_replicas=2, max_restarts=0, env={"OMP_NUM_THREADS": "1", **(env or {})})
    job.start()
    try:
        local_job_module.run_plain_deepspeed(str(tmp_path), 2 * group_size, ["--out", str(plain_out), *extra], 240,
                                             script=worker)
    except RuntimeError as e:
        raise AssertionError(str(e)) from None
    codes = job.wait(timeout_s=240)
    assert codes == {0: 0, 1: 0}, job.tails()
    ranks = range(2 * group_size)
    return ([torch.load(ft_out / f"result_{r}.pt") for r in ranks],
            [torch.load(plain_out / f"result_{r}.pt") for r in ranks])
