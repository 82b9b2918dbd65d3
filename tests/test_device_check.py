"""The device check (ftbridge.harness.bench.device_check): its pure parts by default, its CPU dry run as a slow test."""

from __future__ import annotations

import json

import pytest
import torch

from ftbridge.harness.bench import device_check as dc


def test_plans_and_sizes():
    gpu, dry = dc.make_plan(False), dc.make_plan(True)
    assert gpu.device == "cuda" and dry.device == "cpu"
    big = gpu.big_model
    params = 12 * big["n_layer"] * big["d_model"] ** 2
    assert params >= 2e8, f"the overhead model ({params:.2e} parameters) would not keep a GPU busy"
    assert dry.big_model["d_model"] * dry.big_model["n_layer"] < 1000
    assert len(gpu.stages) * len(gpu.dtypes) * len(gpu.overlaps) == 12
    assert dc.model_flags({"n_layer": 2, "micro_batch": 4}) == ["--n-layer", "2", "--micro-batch", "4"]


def test_max_abs_diff_and_table():
    a = {"w": torch.zeros(3), "b": torch.ones(2, dtype=torch.bfloat16)}
    b = {"w": torch.tensor([0.0, -0.5, 0.25]), "b": torch.ones(2, dtype=torch.bfloat16)}
    assert dc.max_abs_diff(a, b) == 0.5 and dc.max_abs_diff(a, a) == 0.0
    with pytest.raises(ValueError, match="names differ"):
        dc.max_abs_diff(a, {"w": a["w"]})
    rows = [{"part": "equivalence", "config": "z1_fp32_serial", "max_abs_diff": 3.7e-9, "ok": True},
            {"part": "failover", "config": "z2 kill group 1", "ok": False, "error": "TimeoutError: x"}]
    table = dc.render_table(rows, "header")
    assert table.splitlines()[0] == "header"
    assert "z1_fp32_serial" in table and "ok" in table and "FAIL" in table and "3.7e-09" in table


def test_d2h2d_copy_on_cpu():
    assert dc.d2h2d_seconds(1 << 20, "cpu") > 0


def test_main_refuses_unknown_parts_and_no_gpu(capsys):
    with pytest.raises(SystemExit):
        dc.main(["--only", "everything"])
    assert "choose among" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            dc.main(["--only", "overhead"])
        assert "pass --dry-run" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_dry_run_cheapest_part(tmp_path):
    """One equivalence configuration of the dry run end to end (about 70 s on 2 cores)."""
    out = tmp_path / "dc"
    code = dc.main(["--dry-run", "--only", "equivalence", "--stages", "2", "--dtypes", "fp32", "--overlap", "off",
                    "--out", str(out)])
    result = json.loads((out / "results.json").read_text())
    assert code == 0, result
    (row,) = result["rows"]
    assert row["ok"] and row["replicas_equal"] and row["max_abs_diff"] < 1e-6
    assert "z2_fp32_serial" in (out / "table.txt").read_text()


def test_extras_rows_are_well_formed_and_an_unverified_checkpoint_fails_its_row(tmp_path):
    for name, (stage, dtype, _overlap, flags, exact) in dc.EXTRAS.items():
        assert stage in (1, 2, 3) and dtype in dc.TOLERANCE and flags, name
        assert exact == ("--comm-hook" not in flags), f"{name}: only a compressed all-reduce may differ"
    assert dc._verified_checkpoints(str(tmp_path)) == 0


def test_a_failed_part_keeps_the_ranks_log_tails_out_of_the_table(capsys):
    """A part that fails once on a lent machine must be readable afterwards: its message after the first
    line (the ranks' log tails, as ``run_ftbridge`` raises it) is kept in the row and printed under it."""

    def failing():
        raise RuntimeError("ftbridge run in /x failed, exit codes {0: 1, 1: None}\n--- group 0 rank 0 ---\n"
                           "ValueError: the real cause")

    row = dc._timed_row(("z3_fp32_hook_power_sgd", failing))
    assert not row["ok"] and row["part"] == "extras"
    assert row["error"].startswith("RuntimeError: ftbridge run in /x failed")
    assert "the real cause" in row["detail"]
    assert "the real cause" in capsys.readouterr().out
    assert "the real cause" not in dc.render_table([row])
