"""Prometheus metrics of a replica group: fed by event records, served on /metrics, set by config."""

from __future__ import annotations

import urllib.request
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ftbridge import metrics as metrics_mod
from ftbridge.config import FTBridgeConfig
from ftbridge.events import EventLog
from ftbridge.metrics import GroupMetrics


def scrape(address: str) -> dict:
    """``{(sample name, sorted labels): value}`` of one /metrics answer."""
    with urllib.request.urlopen(address, timeout=5) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def _step(step, committed=True, healed=False, time=100.0, participants=2, quorum_id=3, step_time_s=0.25):
    return dict(time=time, step=step, quorum_id=quorum_id, participants=participants, replica_rank=0,
                committed=committed, healed=healed, loss=1.0, step_time_s=step_time_s, param_checksum=None)


def test_records_update_metrics_and_scrape_follows_conventions():
    sent = {"bytes": 0, "wait": 0.0}
    m = GroupMetrics(1, bytes_fn=lambda: sent["bytes"], wait_fn=lambda: sent["wait"])
    try:
        address = m.serve("127.0.0.1", 0)
        assert address.startswith("http://127.0.0.1:") and address.endswith("/metrics")
        before = scrape(address)
        assert value(before, "ftbridge_steps_committed_total", replica_group="1") == 0  # exported from the start
        for rec in (_step(1), _step(2, committed=False), _step(3, healed=True, time=110.0, participants=1,
                                                                quorum_id=4, step_time_s=0.5)):
            m.observe(rec)
        m.observe(dict(event="heal_transfer", step=3, bytes=1000, start=100.0, fetched=101.5, time=102.0))
        m.observe(dict(event="checkpoint_saved", step=3, path="x"))
        m.observe(dict(event="checkpoint_stall", step=3, stall_s=0.2))
        m.observe(dict(event="divergence", step=3))
        m.observe(dict(event="something_new", step=3))  # ignored
        sent.update(bytes=4096, wait=1.5)
        got = scrape(address)
    finally:
        m.close()
    g = {"replica_group": "1"}
    assert value(got, "ftbridge_steps_committed_total", **g) == 2
    assert value(got, "ftbridge_steps_discarded_total", **g) == 1
    assert value(got, "ftbridge_participants", **g) == 1
    assert value(got, "ftbridge_quorum_id", **g) == 4
    assert value(got, "ftbridge_step", **g) == 3
    assert value(got, "ftbridge_last_step_seconds", **g) == 0.5
    assert value(got, "ftbridge_heals_total", **g) == 1
    assert value(got, "ftbridge_heal_bytes_total", **g) == 1000
    for phase, seconds in (("transfer", 1.5), ("decode", 0.5), ("apply", 8.0)):
        assert value(got, "ftbridge_heal_duration_seconds_count", phase=phase, **g) == 1
        assert value(got, "ftbridge_heal_duration_seconds_sum", phase=phase, **g) == pytest.approx(seconds)
    assert value(got, "ftbridge_checkpoint_saves_total", **g) == 1
    assert value(got, "ftbridge_checkpoint_stall_seconds_count", **g) == 1
    assert value(got, "ftbridge_checkpoint_stall_seconds_sum", **g) == pytest.approx(0.2)
    assert value(got, "ftbridge_divergences_total", **g) == 1
    assert value(got, "ftbridge_cross_replica_bytes_total", **g) == 4096
    assert value(got, "ftbridge_cross_replica_wait_seconds_total", **g) == 1.5
    # Every metric is ftbridge_-prefixed and labelled with its group; nothing from the process-wide registry.
    names = {name for name, _ in got}
    assert all(n.startswith("ftbridge_") for n in names), names
    assert all(dict(labels).get("replica_group") == "1" for _, labels in got)
    with pytest.raises(OSError):
        urllib.request.urlopen(address, timeout=2)  # closed


def test_event_log_feeds_listeners_without_a_file_and_survives_a_broken_one():
    log = EventLog(None, {"replica_group": 0, "group_rank": 0})
    seen = []
    log.add_listener(lambda rec: 1 / 0)
    log.add_listener(seen.append)
    log.write(event="x", step=1)
    log.write(event="y", step=2)
    assert [r["event"] for r in seen] == ["x", "y"] and seen[0]["replica_group"] == 0


def test_metrics_port_setting():
    assert FTBridgeConfig.resolve(environ={}).metrics_port is None
    assert FTBridgeConfig.resolve(environ={"FTBRIDGE_METRICS_PORT": "0"}).metrics_port == 0
    assert FTBridgeConfig.resolve(environ={"FTBRIDGE_METRICS_PORT": "9400"}, metrics_port=9401).metrics_port == 9401
    with pytest.raises(ValueError, match="metrics_port=70000 is not a port"):
        FTBridgeConfig.resolve(environ={"FTBRIDGE_METRICS_PORT": "70000"})
    with pytest.raises(ValueError, match="FTBRIDGE_METRICS_PORT='x'"):
        FTBridgeConfig.resolve(environ={"FTBRIDGE_METRICS_PORT": "x"})


def _fake_engine(tmp_path, **cfg):
    cfg = FTBridgeConfig.resolve(environ={}, **cfg)
    return SimpleNamespace(cfg=cfg, events=EventLog(str(tmp_path / "ev.jsonl"), {}),
                           sync=SimpleNamespace(bytes_sent=7), cross_replica_wait_s=0.0)


def test_attach_serves_on_rank_0_only_on_the_heal_bind(tmp_path, capsys):
    assert metrics_mod.attach(_fake_engine(tmp_path)) is None  # unset: off
    assert metrics_mod.attach(_fake_engine(tmp_path, metrics_port=0, group_size=2, group_rank=1)) is None
    engine = _fake_engine(tmp_path, metrics_port=0, replica_group_id=2, num_replica_groups=3)
    m = metrics_mod.attach(engine)
    try:
        assert m.address.startswith("http://127.0.0.1:")
        assert f"ftbridge metrics: {m.address} (replica group 2)" in capsys.readouterr().out
        engine.events.write(**_step(5))  # through the event log
        got = scrape(m.address)
        assert value(got, "ftbridge_steps_committed_total", replica_group="2") == 1
        assert value(got, "ftbridge_cross_replica_bytes_total", replica_group="2") == 7
        taken = int(m.address.rsplit(":", 1)[1].split("/")[0])
        with pytest.raises(OSError, match="FTBRIDGE_METRICS_PORT"):
            metrics_mod.attach(_fake_engine(tmp_path, metrics_port=taken))
    finally:
        m.close()
        engine.events.close()
    assert '"event": "metrics"' in (tmp_path / "ev.jsonl").read_text()
