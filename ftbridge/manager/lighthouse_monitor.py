"""Whether the lighthouse answers ``GET /status`` within a deadline (never judged by a TCP connect, which a
hung lighthouse or a proxy accepts): :class:`LighthouseMonitor`, probing in a helper thread so its caller,
group rank 0's quorum thread, never blocks. Why: docs/concepts.md, "The commit protocol" (QUORUM).
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from typing import Callable, Optional

from ftbridge.manager.futures import in_thread

logger = logging.getLogger(__name__)


def probe_status(address: str, timeout_s: float) -> None:
    """Return once the lighthouse at ``address`` answered ``GET /status`` with its status page.

    Raises:
        OSError, ValueError: no answer within ``timeout_s``, an HTTP error, or not a lighthouse's page.
    """
    from ftbridge.manager.lighthouse_status import fetch_status

    fetch_status(address, timeout_s=timeout_s)


class LighthouseMonitor:
    """Whether the lighthouse at ``address`` answers, from probes run one at a time in a helper thread.

    ``deadline`` (> 0) is a probe's timeout; ``probe(address, timeout_s)`` returns on an answer and raises
    otherwise (default :func:`probe_status`); ``clock`` gives monotonic seconds.
    """

    def __init__(self, address: str, *, deadline: timedelta, probe: Callable[[str, float], None] = probe_status,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if deadline <= timedelta(0):
            raise ValueError(f"deadline={deadline} must be positive (FTBRIDGE_LIGHTHOUSE_PROBE_TIMEOUT_MS)")
        self._address, self._deadline, self._probe, self._clock = address, deadline.total_seconds(), probe, clock
        self._lock = threading.Lock()
        self._inflight: Optional[float] = None  # start of the probe in flight
        self._last: Optional[tuple] = None  # (start, answered) of the last finished probe
        self.probes = 0

    def answers(self, since: float) -> Optional[bool]:
        """The lighthouse's state from a probe started at or after ``since`` (monotonic s); starts one if none is in
        flight.

        Returns:
            ``True`` once it got an answer (a late answer, read after a pause of this process, counts);
            ``False`` once it failed, or is still in flight at twice the deadline; ``None`` while too early to say.
        """
        with self._lock:
            now = self._clock()
            if self._last is not None and self._last[0] >= since:
                return self._last[1]
            if self._inflight is None:
                self._start(now)
                return None
            if now - self._inflight >= 2 * self._deadline:  # its own timeout should have ended it long ago
                return False
            return None

    def _start(self, now: float) -> None:
        self._inflight = now
        self.probes += 1

        def run() -> None:  # records its outcome itself: the caller holds the lock while this starts
            try:
                self._probe(self._address, self._deadline)
                ok = True
            except Exception as exc:  # noqa: BLE001 - any failure means "does not answer"
                logger.debug("lighthouse probe of %s failed: %s: %s", self._address, type(exc).__name__, exc)
                ok = False
            with self._lock:
                self._last, self._inflight = (now, ok), None

        in_thread(run, "ftbridge-lighthouse-probe")


