"""Chaos testing: inject failures into a running job and check that it survives them.

* :mod:`ftbridge.chaos.schedule` - which failures, when (seeded, pure);
* :mod:`ftbridge.chaos.inject` - doing one failure to a running job;
* :mod:`ftbridge.chaos.invariants` - what must hold, checked on the event logs (pure);
* :mod:`ftbridge.chaos.runner` - the run: job, schedule, recovery, checks;
* :mod:`ftbridge.chaos.report` - JSON summary, table and plot;
* :mod:`ftbridge.chaos.cli` - ``ftbridge-chaos``.
"""
