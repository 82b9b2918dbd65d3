"""Prometheus metrics of one replica group, served by its group rank 0 at ``/metrics``.

Off unless ``metrics_port`` (``FTBRIDGE_METRICS_PORT``) is set; ``0`` picks a free
port. :func:`attach` makes group rank 0 serve ``http://HEAL_BIND:PORT/metrics``,
print the address and write it as a ``metrics`` event. :class:`GroupMetrics`
listens to the engine's event log (:meth:`ftbridge.events.EventLog.add_listener`)
and reads the cross-replica totals from the engine at scrape time; each owns
its own ``CollectorRegistry``, so several engines in one process do not clash.
Metric list, units and alert rules: docs/monitoring.md.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

HEAL_PHASES = ("transfer", "decode", "apply")
"""Phases of one heal as the joining rank 0 sees them: ``transfer`` (fetch start
to body received), ``decode`` (body to tensors), ``apply`` (decoded to the end
of the healing step: load into DeepSpeed, the step itself)."""

_SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _EngineTotals(Collector):
    """Cross-replica bytes and exposed wait, read from the engine when scraped."""

    def __init__(self, group: str, bytes_fn: Callable[[], float], wait_fn: Callable[[], float]) -> None:
        self._group, self._bytes_fn, self._wait_fn = group, bytes_fn, wait_fn

    def collect(self) -> Iterator[CounterMetricFamily]:
        sent = CounterMetricFamily("ftbridge_cross_replica_bytes",
                                   "Payload bytes this rank handed to the cross-replica all-reduce",
                                   labels=["replica_group"])
        sent.add_metric([self._group], float(self._bytes_fn()))
        wait = CounterMetricFamily("ftbridge_cross_replica_wait_seconds",
                                   "Seconds the optimizer step waited for cross-replica all-reduces that "
                                   "backward did not hide (exposed communication)", labels=["replica_group"])
        wait.add_metric([self._group], float(self._wait_fn()))
        yield sent
        yield wait


class GroupMetrics:
    """The metrics of one replica group, fed by its event records.

    Args:
        replica_group: the group's id (the ``replica_group`` label).
        bytes_fn: returns the cross-replica payload bytes sent so far (int).
        wait_fn: returns the exposed cross-replica wait so far (seconds).

    Attributes:
        registry: this group's own ``CollectorRegistry``.
        address: ``http://HOST:PORT/metrics`` once :meth:`serve` ran, else ``None``.
    """

    def __init__(self, replica_group: int, *, bytes_fn: Callable[[], float] = lambda: 0,
                 wait_fn: Callable[[], float] = lambda: 0.0) -> None:
        self.group = str(replica_group)
        self.registry = CollectorRegistry(auto_describe=True)
        self.address: Optional[str] = None
        self._server: Optional[Tuple[Any, Any]] = None
        self._last_step_time: Optional[float] = None
        r, g = self.registry, ["replica_group"]
        self.committed = Counter("ftbridge_steps_committed", "Optimizer steps committed", g, registry=r)
        self.discarded = Counter("ftbridge_steps_discarded", "Optimizer steps discarded (not applied)", g, registry=r)
        self.step = Gauge("ftbridge_step", "Committed steps of the job as this group knows them (torchft step)",
                          g, registry=r)
        self.participants = Gauge("ftbridge_participants", "Replica groups in the last step's quorum", g, registry=r)
        self.quorum_id = Gauge("ftbridge_quorum_id", "torchft quorum id of the last step", g, registry=r)
        self.last_step = Gauge("ftbridge_last_step_seconds", "Wall time of the last optimizer step (first forward "
                               "to step end)", g, registry=r)
        self.heals = Counter("ftbridge_heals", "Heals this group received from a live peer", g, registry=r)
        self.heal_bytes = Counter("ftbridge_heal_bytes", "Bytes of heal state received", g, registry=r)
        self.heal_seconds = Histogram("ftbridge_heal_duration_seconds", "Duration of one heal by phase "
                                      "(transfer, decode, apply)", [*g, "phase"], buckets=_SECONDS_BUCKETS,
                                      registry=r)
        self.saves = Counter("ftbridge_checkpoint_saves", "Checkpoints this group published", g, registry=r)
        self.stall = Histogram("ftbridge_checkpoint_stall_seconds", "Seconds training stood still for one "
                               "checkpoint save", g, buckets=_SECONDS_BUCKETS, registry=r)
        self.divergences = Counter("ftbridge_divergences", "Divergence guard mismatches seen", g, registry=r)
        for metric in (self.committed, self.discarded, self.heals, self.heal_bytes, self.saves, self.divergences):
            metric.labels(self.group)  # exported at 0 from the start, so rate() and absent() work
        r.register(_EngineTotals(self.group, bytes_fn, wait_fn))

    def observe(self, record: Dict[str, Any]) -> None:
        """Update the metrics from one event-log record (:mod:`ftbridge.events`); unknown events are ignored."""
        kind, g = record.get("event"), self.group
        if kind is None and "committed" in record:
            (self.committed if record["committed"] else self.discarded).labels(g).inc()
            self.participants.labels(g).set(record.get("participants") or 0)
            self.quorum_id.labels(g).set(record.get("quorum_id") or 0)
            self.step.labels(g).set(record.get("step") or 0)
            if record.get("step_time_s") is not None:
                self.last_step.labels(g).set(record["step_time_s"])
            if record.get("healed"):
                self.heals.labels(g).inc()
            self._last_step_time = record.get("time")
        elif kind == "heal_transfer":
            self._observe_heal(record)
        elif kind == "checkpoint_saved":
            self.saves.labels(g).inc()
        elif kind == "checkpoint_stall" and record.get("stall_s") is not None:
            self.stall.labels(g).observe(record["stall_s"])
        elif kind == "divergence":
            self.divergences.labels(g).inc()

    def _observe_heal(self, rec: Dict[str, Any]) -> None:
        """Phases of one heal from its ``heal_transfer`` event (written right after the healing step's record)."""
        start, fetched, end = rec.get("start"), rec.get("fetched"), rec.get("time")
        if start is None or fetched is None or end is None:
            return
        self.heal_bytes.labels(self.group).inc(rec.get("bytes") or 0)
        phases = {"transfer": fetched - start, "decode": end - fetched}
        if self._last_step_time is not None and self._last_step_time >= end:
            phases["apply"] = self._last_step_time - end
        for phase, seconds in phases.items():
            self.heal_seconds.labels(self.group, phase).observe(max(0.0, seconds))

    def serve(self, host: str, port: int) -> str:
        """Serve ``/metrics`` on ``host:port`` (0: a free port) in a daemon thread; return the address.

        Raises:
            OSError: the port cannot be bound.
        """
        httpd, thread = start_http_server(port, addr=host, registry=self.registry)
        self._server = (httpd, thread)
        bound = httpd.server_address[1]
        shown = f"[{host}]" if ":" in host else host
        self.address = f"http://{shown}:{bound}/metrics"
        return self.address

    def close(self) -> None:
        """Stop serving (idempotent)."""
        if self._server is not None:
            httpd, thread = self._server
            self._server = None
            httpd.shutdown()
            httpd.server_close()
            thread.join(timeout=5)


def attach(engine: Any) -> Optional[GroupMetrics]:
    """Serve this replica group's metrics from ``engine`` when its settings ask for it.

    Only group rank 0 with ``cfg.metrics_port`` set serves, on ``cfg.heal_bind``.

    Args:
        engine: a :class:`~ftbridge.engine.FaultTolerantEngine` (reads ``cfg``, ``events``,
            ``sync.bytes_sent`` and ``cross_replica_wait_s``).

    Returns:
        The :class:`GroupMetrics`, or ``None`` when metrics are off or this is not group rank 0.

    Raises:
        OSError: the metrics port cannot be bound.
    """
    cfg = engine.cfg
    if cfg.metrics_port is None or cfg.group_rank != 0:
        return None
    metrics = GroupMetrics(cfg.replica_group_id, bytes_fn=lambda: engine.sync.bytes_sent,
                           wait_fn=lambda: getattr(engine, "cross_replica_wait_s", 0.0))
    try:
        address = metrics.serve(cfg.heal_bind, cfg.metrics_port)
    except OSError as exc:
        raise OSError(f"cannot serve metrics on {cfg.heal_bind}:{cfg.metrics_port} (FTBRIDGE_METRICS_PORT): {exc}; "
                      "pick another port, or 0 for a free one") from exc
    engine.events.add_listener(metrics.observe)
    print(f"ftbridge metrics: {address} (replica group {cfg.replica_group_id})", flush=True)
    engine.events.write(event="metrics", time=time.time(), address=address)
    logger.info("serving metrics at %s", address)
    return metrics
