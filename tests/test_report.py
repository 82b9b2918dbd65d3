"""Run summaries and plots from event records (no processes)."""

from __future__ import annotations

from ftbridge.harness.report import plot_run, summarize


def _events(checksums, lonely=False):
    ev = []
    for g in (0, 1):
        for r in (0, 1):
            ev.append({"replica_group": g, "group_rank": r, "event": "start", "time": 0.0 + g, "pid": 1})
            for step in (1, 2):
                ev.append({"replica_group": g, "group_rank": r, "time": step + g / 10, "step": step,
                           "quorum_id": 1, "participants": 2, "replica_rank": g, "committed": True,
                           "healed": g == 1 and step == 1, "loss": 4.0 - step, "param_checksum": "x"})
            ev.append({"replica_group": g, "group_rank": r, "event": "final", "time": 3.0, "step": 2,
                       "val_loss": 2.5, "param_checksum": checksums[g], "optimizer_checksum": f"o{r}",
                       "heals": int(g == 1)})
    if lonely:
        ev.append({"replica_group": 1, "group_rank": 0, "event": "restart_without_peer", "time": 2.5,
                   "step": 1, "attempt": 1})
    return sorted(ev, key=lambda e: e["time"])


def test_identical_replicas_are_reported_identical():
    s = summarize(_events(["a", "a"]), 2, 2)
    assert s.identical
    assert s.heals == {0: 0, 1: 1} and s.steps_committed == {0: 2, 1: 2}
    assert "ends identical" in s.table()


def test_differing_replicas_and_a_lonely_restart_are_reported():
    s = summarize(_events(["a", "b"], lonely=True), 2, 2)
    assert not s.identical
    table = s.table()
    assert "REPLICAS DIFFER" in table and "restarted with no live peer" in table


def test_missing_rank_is_not_identical():
    ev = [e for e in _events(["a", "a"]) if not (e.get("event") == "final" and e["replica_group"] == 1
                                                 and e["group_rank"] == 1)]
    assert not summarize(ev, 2, 2).identical


def test_plot_writes_a_png(tmp_path):
    path = plot_run(_events(["a", "a"]), str(tmp_path / "run.png"), markers=[(1.5, "SIGKILL group 1")])
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
