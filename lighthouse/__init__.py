"""ftbridge's lighthouse service: torchft's lighthouse with checked settings.

:func:`lighthouse.server.start_lighthouse` runs it, :class:`lighthouse.health.LighthouseMonitor` serves
its health and status page, :func:`lighthouse.checks.check_timeouts` checks its timeouts against the
job's; the command line is :mod:`lighthouse.cli`. Operator guide: ``docs/lighthouse.md``.
"""

from lighthouse.server import LighthouseService, start_lighthouse

__all__ = ["LighthouseService", "start_lighthouse"]
