"""Chaos testing: inject failures into a running job and check that it survives them.

* :mod:`ftbridge.harness.chaos.schedule` - which failures, when (seeded, pure);
* :mod:`ftbridge.harness.chaos.inject` - doing one failure to a running job;
* :mod:`ftbridge.harness.chaos.invariants` - what must hold, checked on the event logs (pure);
* :mod:`ftbridge.harness.chaos.runner` - the run: job, schedule, recovery, checks after each failure;
* :mod:`ftbridge.harness.chaos.verdict` - the checks on the whole run once it stopped (with
  :mod:`~ftbridge.harness.chaos.coverage`, :mod:`~ftbridge.harness.chaos.deaths` and
  :mod:`~ftbridge.harness.chaos.spares` beside it);
* :mod:`ftbridge.harness.chaos.report` - JSON summary, table and plot;
* :mod:`ftbridge.harness.chaos.cli` - ``ftbridge-chaos``.
"""
