"""ftbridge's lighthouse service: torchft's lighthouse with checked settings.

Python: :func:`lighthouse.server.start_lighthouse` (run it),
:func:`ftbridge.manager.lighthouse_status.fetch_status` (read its quorum),
:class:`lighthouse.health.LighthouseMonitor` (gRPC health and a status page),
:func:`lighthouse.checks.check_timeouts` (its timeouts against the job's).
Command line: ``ftbridge-lighthouse serve|status|health`` (:mod:`lighthouse.cli`).
Operator guide: ``docs/lighthouse.md``.
"""

from lighthouse.server import LighthouseService, start_lighthouse

__all__ = ["LighthouseService", "start_lighthouse"]
