"""Adding up a soak's slices: ``ftbridge.harness.chaos.soak`` and ``ftbridge-chaos --summarize``."""

import json

import pytest

from ftbridge.harness.chaos import soak
from ftbridge.harness.chaos.cli import main


def _report(seed, *, ok=True, kinds=None, slots=False):
    kinds = kinds or {"kill_group": {"injected": 2, "skipped": 1, "survived": 2, "survivors_s": [1.0, 3.0],
                                     "rejoin_s": [9.0], "discarded": 4, "outage_steps_lost": [],
                                     "outage_pause_s": []}}
    checks = [{"name": "commits monotonic", "held": True, "judged": "", "violations": []},
              {"name": "recovered from every failure", "held": ok, "judged": "", "violations": []}]
    if slots:
        checks.append({"name": "same samples as the failure-free run", "held": True, "judged": "",
                       "violations": []})
    return {"ok": ok, "settings": {"groups": 3, "nproc": 2, "seed": seed, "spares": 0, "recovery_bound_s": 18.0},
            "wall_s": 600.0, "final_step": 100, "final_val_loss": 1.5, "failure_free_val_loss": 1.25,
            "heals": 3, "steps_discarded": 7, "by_kind": kinds, "checks": checks, "failures": []}


def _write(tmp_path, name, report):
    d = tmp_path / name
    d.mkdir()
    (d / "chaos.json").write_text(json.dumps(report))
    return str(d)


def test_slices_add_up_per_kind_and_the_sum_reloads_to_take_more_slices(tmp_path):
    lighthouse = {"injected": 1, "skipped": 0, "survived": 1, "survivors_s": [0.1], "rejoin_s": [],
                  "discarded": 0, "outage_steps_lost": [2.0], "outage_pause_s": [0.3]}
    a = _write(tmp_path, "a", _report(1))
    b = _write(tmp_path, "b", _report(2, slots=True, kinds={**_report(2)["by_kind"], "lighthouse_hang": lighthouse}))
    total = soak.add_up(soak.load(a) + soak.load(b))
    assert total.injected == 5 and total.ok
    row = total.by_kind["kill_group"]
    assert (row["injected"], row["skipped"], row["discarded"]) == (4, 2, 8)
    assert row["survivors_s"] == [1.0, 3.0, 1.0, 3.0]
    assert [s.slots for s in total.slices] == [False, True]
    assert total.slices[0].loss_diff == 0.25
    text = soak.table(total)
    assert "5 failures injected in 2 slices" in text and "every check held in 2 of 2 slices" in text
    paths = soak.write(total, str(tmp_path / "out"))
    c = _write(tmp_path, "c", _report(3))
    again = soak.add_up(soak.load(paths[0]) + soak.load(c))
    assert [s.seed for s in again.slices] == [1, 2, 3]
    assert again.by_kind["kill_group"]["injected"] == 6 and again.by_kind["lighthouse_hang"]["injected"] == 1


def test_a_slice_counts_once_and_bad_reports_are_refused_naming_the_file(tmp_path, monkeypatch):
    a = _write(tmp_path, "a", _report(1))
    with pytest.raises(ValueError, match="seed 1 twice"):
        soak.add_up(soak.load(a) + soak.load(a))
    with pytest.raises(ValueError, match="no slice"):
        soak.add_up([])
    bad = _report(2)
    del bad["by_kind"]
    b = _write(tmp_path, "b", bad)
    with pytest.raises(ValueError, match="b/chaos.json: not a chaos report, no by_kind"):
        soak.load(b)
    broken = _report(3, kinds={"hang": {"injected": 1}})
    with pytest.raises(ValueError, match="'hang' has no usable"):
        soak.load(_write(tmp_path, "c", broken))
    monkeypatch.setattr(soak, "MAX_REPORT_BYTES", 10)
    with pytest.raises(ValueError, match="limit"):
        soak.load(a)


def test_summarize_writes_the_report_and_exits_by_the_slices_verdict(tmp_path, capsys):
    good, bad = _write(tmp_path, "good", _report(1)), _write(tmp_path, "bad", _report(2, ok=False))
    out = tmp_path / "sum"
    assert main(["--summarize", good, "--out", str(out)]) == 0
    assert {p.name for p in out.iterdir()} == {"soak.json", "soak.txt", "soak.png"}
    assert main(["--summarize", good, bad, "--out", str(out)]) == 1
    assert "every check held in 1 of 2 slices" in capsys.readouterr().out
    assert main(["--summarize", str(tmp_path / "missing"), "--out", str(out)]) == 2
    assert "--summarize" in capsys.readouterr().err
