"""ftbridge's lighthouse service: torchft's lighthouse with checked settings.

Python: :func:`lighthouse.server.start_lighthouse`; command line:
``ftbridge-lighthouse serve`` (:mod:`lighthouse.cli`).
"""

from lighthouse.server import LighthouseService, start_lighthouse

__all__ = ["LighthouseService", "start_lighthouse"]
