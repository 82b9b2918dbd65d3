"""Chaos testing: inject failures into a running job and check that it survives them.

* :mod:`ftbridge.harness.chaos.schedule` - which failures, when (seeded, pure);
* :mod:`ftbridge.harness.chaos.inject` - doing one failure to a running job;
* :mod:`ftbridge.harness.chaos.invariants` - what must hold, checked on the event logs (pure);
* :mod:`ftbridge.harness.chaos.runner` - the run: job, schedule, recovery, checks;
* :mod:`ftbridge.harness.chaos.report` - JSON summary, table and plot;
* :mod:`ftbridge.harness.chaos.cli` - ``ftbridge-chaos``.
"""
