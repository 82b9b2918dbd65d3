"""The job and test harness around the runtime: what trains, runs, breaks and measures ftbridge jobs.

Not part of the library a training script imports (that is :mod:`ftbridge`'s runtime: the engine,
the manager, ZeRO, heal, checkpoints, ``ftbridge-run``); kept apart as Accelerate keeps
``accelerate.test_utils``. The runtime and :mod:`lighthouse` never import from here
(``tests/test_boundaries.py``); the harness imports the runtime.

* :mod:`ftbridge.harness.lm_job`: the character-level language-model job of ``scripts/train_lm.py``;
* :mod:`ftbridge.harness.data`, :mod:`ftbridge.harness.models`: its sharded data and its small GPT;
* :mod:`ftbridge.harness.local_job`: a whole job on one machine (lighthouse plus replica groups);
* :mod:`ftbridge.harness.report`: run summaries and plots from the event logs;
* :mod:`ftbridge.harness.chaos`: ``ftbridge-chaos``, failure schedules, injection and invariants;
* :mod:`ftbridge.harness.bench`: ``ftbridge-bench``, the benchmark suite and the GPU device check.
"""
