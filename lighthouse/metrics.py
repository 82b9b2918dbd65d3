"""Prometheus metrics of a lighthouse, served at ``/metrics`` on the status port.

Gauges built at each scrape from the monitor's last probe (:mod:`lighthouse.health`); nothing is
asked of the lighthouse at scrape time. While it is down ``ftbridge_lighthouse_up`` is 0 and the
rest stay at the last successful probe. The metrics: ``docs/monitoring.md``, "Lighthouse metrics".
"""

from __future__ import annotations

import time
from typing import Any, Dict, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ftbridge.manager.lighthouse_status import replica_group_of


class LighthouseCollector(Collector):
    """Builds the lighthouse metrics from a :class:`~lighthouse.health.LighthouseMonitor` at each scrape."""

    def __init__(self, monitor: Any) -> None:
        self._monitor = monitor

    def collect(self) -> Iterator[GaugeMetricFamily]:
        mon = self._monitor
        with mon._lock:
            status, serving, probed = mon.last_status, mon.serving, mon.last_success_monotonic
        yield _gauge("up", "1 while the last probe of the lighthouse succeeded (health), else 0", float(serving))
        if status is None:
            return
        since = max(0.0, time.monotonic() - probed) if probed is not None else 0.0
        yield _gauge("probe_age_seconds", "Seconds since the last successful probe of the lighthouse", since)
        yield _gauge("quorum_id", "The lighthouse's current quorum id", status.quorum_id)
        yield _gauge("participants", "Replica groups in the last quorum issued", len(status.members))
        yield _gauge("heartbeating_groups", "Replica ids heartbeating within the lighthouse's heartbeat timeout",
                     sum(1 for h in status.heartbeats if not h.stale))
        if status.quorum_age_s is not None:
            yield _gauge("seconds_since_last_quorum", "Seconds since the lighthouse issued its last quorum",
                         status.quorum_age_s + since)
        ages: Dict[str, float] = {}
        for h in status.heartbeats:  # a restarted group has a new replica id: keep its freshest
            group = _group_of(h.replica_id)
            ages[group] = min(ages.get(group, float("inf")), h.age_s + since)
        fam = GaugeMetricFamily("ftbridge_lighthouse_heartbeat_age_seconds",
                                "Seconds since the lighthouse last heard from each replica group",
                                labels=["replica_group"])
        for group, age in sorted(ages.items()):
            fam.add_metric([group], age)
        yield fam


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"ftbridge_lighthouse_{name}", doc, value=float(value))


def _group_of(replica_id: str) -> str:
    """ftbridge's group id from ``replica_group_G:UUID``; other torchft replica ids as they are."""
    group = replica_group_of(replica_id)
    return replica_id if group is None else str(group)


def registry_for(monitor: Any) -> CollectorRegistry:
    """A fresh ``CollectorRegistry`` holding only the lighthouse metrics of ``monitor``."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(LighthouseCollector(monitor))
    return registry
