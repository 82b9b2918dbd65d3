"""Unit tests of the benchmark suite: metrics, report rendering, plots, CLI validation and failure capture.

No training processes: benchmarks are replaced by fakes and the plots are
drawn from synthetic metrics shaped like the real ones.
"""

from __future__ import annotations

import json
import math
import os
import signal
from types import SimpleNamespace

import pytest

from ftbridge.harness.bench import cli, core, jobs, report
from ftbridge.harness.bench.core import BenchSettings, Metric, ratio_metric

pytestmark = pytest.mark.timeout(120)


# -- core -------------------------------------------------------------------
def test_ratio_metric_paired_median_target_and_spread():
    m = ratio_metric("overhead", "x", [1.1, 2.2, 3.0], [1.0, 2.0, 3.0], baseline_name="plain", target_max=1.03)
    assert m.samples == pytest.approx([1.1, 1.1, 1.0])
    assert m.value == pytest.approx(1.1) and m.met is False and m.target == "<= 1.03"
    assert m.spread == pytest.approx(0.05)
    assert m.baseline == pytest.approx(2.0)
    assert m.extra["candidate_samples"] == [1.1, 2.2, 3.0]
    assert json.loads(json.dumps(m.to_json()))["spread"] == pytest.approx(0.05)
    assert ratio_metric("heal", "y", [3.0], [4.0], baseline_name="b", target_min=0.5).met is True


def test_ratio_metric_rejects_bad_baselines():
    with pytest.raises(ValueError, match="must be > 0"):
        ratio_metric("b", "n", [1.0], [0.0], baseline_name="x")
    with pytest.raises(ValueError, match="equal repetitions"):
        ratio_metric("b", "n", [1.0, 2.0], [1.0], baseline_name="x")


def test_settings_validation():
    with pytest.raises(ValueError, match="reps=0"):
        BenchSettings(workdir="w", reps=0)
    with pytest.raises(ValueError, match="steps"):
        BenchSettings(workdir="w", steps=0)


# -- jobs (pure helpers) ----------------------------------------------------
def test_steady_median_drops_warmup():
    assert jobs.steady_median([9.0, 9.0, 1.0, 2.0, 3.0], 2) == 2.0
    with pytest.raises(ValueError, match="warm-up"):
        jobs.steady_median([1.0, 2.0], 2)


def test_alternate_swaps_order_every_other_rep():
    calls = []
    a, b = jobs.alternate(3, lambda r: calls.append(("a", r)) or 1.0, lambda r: calls.append(("b", r)) or 2.0,
                          log=lambda s: None)
    assert calls == [("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2)]
    assert a == [1.0] * 3 and b == [2.0] * 3


def test_rotate_lets_each_configuration_lead_once_per_cycle():
    calls = []
    out = jobs.rotate(3, [lambda r, i=i, n=n: calls.append((n, r)) or 10.0 * i + r for i, n in enumerate("abc")])
    assert [n for n, r in calls] == list("abc" "bca" "cab")
    assert [r for n, r in calls] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert out == [[0.0, 1.0, 2.0], [10.0, 11.0, 12.0], [20.0, 21.0, 22.0]]


def test_run_cache_reuses_same_configuration_and_rep_only():
    jobs.clear_cache()
    made = []

    def run():
        made.append(1)
        return jobs.JobResult([{"step_times_s": [len(made)]}])

    try:
        first = jobs._cached(("plain", 2, ("--steps", "9"), 0), run)
        assert jobs._cached(("plain", 2, ("--steps", "9"), 0), run) is first
        jobs._cached(("plain", 2, ("--steps", "9"), 1), run)
        jobs._cached(None, run)
        assert len(made) == 3
    finally:
        jobs.clear_cache()


def test_train_args_and_cross_replica_per_step():
    args = jobs.train_args(steps=12, zero_stage=3, model=jobs.QUICK_MODEL, reduce_bucket_size=2048,
                           extra=["--no-cross-replica-sync"])
    assert args[:4] == ["--steps", "12", "--zero-stage", "3"]
    assert args[args.index("--d-model") + 1] == "64" and args[-3:] == ["--reduce-bucket-size", "2048",
                                                                      "--no-cross-replica-sync"]
    res = jobs.JobResult([{"step_times_s": [1.0], "peak_rss_bytes": 5}],
                         [{"step": 10, "cross_replica_allreduces": 40, "cross_replica_bytes": 4000,
                           "cross_replica_wait_s": 0.05}])
    assert res.cross_replica_per_step() == pytest.approx({"allreduces": 4.0, "bytes": 400.0, "wait_s": 0.005})
    assert res.peak_rss_bytes == [5]
    with pytest.raises(ValueError, match="no final event"):
        jobs.JobResult([{}], workdir="w").cross_replica_per_step()


# -- report -----------------------------------------------------------------
def synthetic_metrics():
    """Metrics shaped like the four steady-state benchmarks' (extras included, so their plots draw)."""
    ov = [ratio_metric("overhead", f"step time ZeRO-{s}", [0.11, 0.12], [0.10, 0.11], baseline_name="plain",
                       target_max=1.03, extra={"zero_stage": s, "baseline_unit": "s"}) for s in (1, 2, 3)]
    ol = ratio_metric("overlap", "per-bucket / post-backward", [0.09, 0.1], [0.1, 0.1], baseline_name="post",
                      target_max=1.0, extra={"buckets": 10, "messages_per_step": 10.0, "note": "aim: 1.2x faster",
                                                  "variant": "finest"})
    mem = ratio_metric("memory", "peak RSS ZeRO-2", [480.0, 481.0], [470.0, 470.0], baseline_name="plain",
                       target_max=1.10, extra={"zero_stage": 2, "baseline_unit": "MiB"})
    sc = [Metric("scaling", f"cross-replica cost {axis} {x}", 1.5 * x, "ms", [1.0 * x, 2.0 * x], baseline=20.0,
                 extra={"axis": axis, "groups": x if axis == "groups" else 2,
                        "params": x * 100_000 if axis == "params" else 100_000, "bytes_per_step": 4e5 * x,
                        "exposed_wait_ms": 0.5 * x, "exposed_wait_samples_ms": [0.4 * x, 0.5 * x, 0.6 * x],
                        "oversubscribed": x > 2})
          for axis in ("groups", "params") for x in (1, 2, 3)]
    return [*ov, ol, mem, *sc]


def test_render_markdown_marks_targets_and_failures():
    settings = BenchSettings(workdir="w", quick=True, reps=2)
    fail = report.failure("heal", RuntimeError("group 1 never healed | x"), 3.5)
    md = report.render_markdown(settings, report.environment(), synthetic_metrics(), [fail])
    rows = [line for line in md.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + 3 + 1 + 1 + 6 + 1  # header, overhead, overlap, memory, scaling, failure
    assert "| overhead | step time ZeRO-1 | 1.095 |" in md and "**NOT met**" in md
    assert "| met |" in md and "| — | — |" in md  # memory met; scaling has no target
    assert "0.105 s (plain)" in md and "470.0 MiB (plain)" in md
    assert "FAILED: RuntimeError: group 1 never healed / x" in md and "## Failures" in md
    assert "aim: 1.2x faster" in md


def test_write_report_writes_json_markdown_and_every_plot(tmp_path):
    cli.load_benchmarks()  # registers the benchmarks' plots
    settings = BenchSettings(workdir=str(tmp_path / "work"), quick=True)
    fail = report.failure("scaling", ValueError("boom"), 1.0)
    one_group = ratio_metric("overhead", "step time ZeRO-2, ftbridge 1x2", [0.105], [0.10], baseline_name="plain",
                             extra={"zero_stage": 2, "ranks_per_group": 2, "decomposition": True, "baseline_unit": "s"})
    from ftbridge.harness.bench import scaling

    watch_off = ratio_metric("overhead", "step time ZeRO-2, ftbridge 2x1 with the peer watch off / with every "
                             "feature on", [0.098], [0.10], baseline_name="ftbridge",
                             extra={"zero_stage": 2, "features_off": True, "baseline_unit": "s"})
    metrics = [*synthetic_metrics(), one_group, watch_off]
    metrics += [scaling.exposed_metric(m) for m in metrics if m.benchmark == "scaling"]
    assert metrics[-1].name == "exposed wait params 3" and metrics[-1].value == pytest.approx(1.5)
    record = report.write_report(str(tmp_path / "out"), settings, metrics, [fail], {"overhead": 1.0})
    assert record["plot_errors"] == {}
    for name in ("bench.json", "bench.md", "overhead.png", "overlap.png", "memory.png", "scaling.png",
                 "overview.png"):
        assert os.path.getsize(tmp_path / "out" / name) > 0, name
    saved = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert saved["settings"]["quick"] is True and saved["environment"]["cpu_count"] == os.cpu_count()
    assert saved["environment"]["torch"] and saved["failures"][0]["error"] == "ValueError: boom"
    assert all(math.isfinite(m["value"]) for m in saved["metrics"])


def test_a_broken_plot_is_recorded_not_raised(tmp_path, monkeypatch):
    def broken(metrics, path):
        raise RuntimeError("no axes")

    monkeypatch.setitem(core.PLOTS, "overhead", broken)
    out = report.write_plots(synthetic_metrics()[:1], str(tmp_path))
    assert out["errors"] == {"overhead": "RuntimeError: no axes"}
    assert out["files"] == [str(tmp_path / "overview.png")]


# -- CLI --------------------------------------------------------------------
def test_select_validates_names():
    names = ["overhead", "overlap", "memory"]
    assert cli.select(None, names) == names
    assert cli.select("memory, overhead,memory", names) == ["memory", "overhead"]
    with pytest.raises(ValueError, match="unknown benchmark\\(s\\) bogus: choose from overhead, overlap, memory"):
        cli.select("overhead,bogus", names)
    with pytest.raises(ValueError, match="names no benchmark"):
        cli.select(",", names)


def test_parse_rejects_unknown_only_before_any_work(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse(["--only", "overhead,nope"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "nope" in err
    assert ("overhead, overlap, failover, heal, heal_100m, restart, rescale, memory, scaling, outage, spare, "
            "straggler") in err


def test_parse_quick_defaults_and_overrides(tmp_path):
    _, s, names = cli.parse(["--quick", "--steps", "4", "--out", str(tmp_path)])
    assert (s.quick, s.reps, s.steps, s.warmup_steps, s.timeout_s) == (True, 1, 4, 3, 300.0)
    assert s.workdir == str(tmp_path / "work") and names == [
        "overhead", "overlap", "failover", "heal", "heal_100m", "restart", "rescale", "memory", "scaling", "outage",
        "spare", "straggler", "slots"]
    _, full, _ = cli.parse(["--reps", "2"])
    assert (full.quick, full.reps, full.steps, full.warmup_steps) == (False, 2, 60, 10)
    with pytest.raises(SystemExit):
        cli.parse(["--reps", "0"])


def test_slots_default_on_and_the_jobs_environment_says_so_while_the_run_lasts(monkeypatch, tmp_path):
    from ftbridge.harness.local_job import LocalJob

    monkeypatch.delenv("FTBRIDGE_SLOTS", raising=False)
    _, on, _ = cli.parse([])
    _, off, _ = cli.parse(["--slots", "off"])
    assert (on.slots, off.slots) == (True, False)
    with pytest.raises(SystemExit):
        cli.parse(["--slots", "2"])
    env: dict = {}
    with core.slots_environment(on, env):
        assert env == {"FTBRIDGE_SLOTS": ""}  # empty: train_lm.py's default, one slot per planned group
    assert env == {}, "the previous environment is restored"
    env = {"FTBRIDGE_SLOTS": "3"}
    with core.slots_environment(off, env):
        assert env["FTBRIDGE_SLOTS"] == "0"
    assert env == {"FTBRIDGE_SLOTS": "3"}
    with core.slots_environment(on):  # a job made meanwhile inherits the empty value (LocalJob's default is 0)
        assert "FTBRIDGE_SLOTS" not in LocalJob(str(tmp_path), 2, 1, []).env
    assert LocalJob(str(tmp_path), 2, 1, []).env["FTBRIDGE_SLOTS"] == "0"


@pytest.mark.parametrize("argv, message", [
    (["--timeout-s", "nan"], "argument --timeout-s: nan is not a finite number"),
    (["--steps", "-5"], "argument --steps: -5 is below the smallest allowed value, 1"),
    (["--warmup-steps", "-1"], "argument --warmup-steps: -1 is below"),
])
def test_bad_numbers_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_out_under_a_regular_file_is_a_usage_error(tmp_path, capsys):
    (tmp_path / "report.txt").write_text("x")
    with pytest.raises(SystemExit) as exc:
        cli.parse(["--out", str(tmp_path / "report.txt" / "bench")])
    assert exc.value.code == 2
    assert f"{tmp_path / 'report.txt'} is a file, not a folder" in capsys.readouterr().err


def test_main_records_a_failing_benchmark_and_keeps_the_others(tmp_path, monkeypatch):
    def good(settings):
        return [Metric("good", "count", 3.0, "steps", [3.0], target="<= 5", met=True)]

    def bad(settings):
        raise RuntimeError("training run failed\nlog tail")

    monkeypatch.setattr(core, "MODULES", ())
    monkeypatch.setattr(core, "REGISTRY", {"bad": bad, "good": good})
    code = cli.main(["--quick", "--out", str(tmp_path)])
    assert code == 1
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert [m["name"] for m in saved["metrics"]] == ["count"]
    assert saved["failures"][0]["benchmark"] == "bad"
    assert "training run failed" in saved["failures"][0]["error"] and "Traceback" in saved["failures"][0]["traceback"]
    assert "**failed**" in (tmp_path / "bench.md").read_text()
    monkeypatch.setattr(core, "REGISTRY", {"good": good})
    assert cli.main(["--out", str(tmp_path)]) == 0


def test_sigterm_stops_the_run_and_still_writes_the_report(tmp_path, monkeypatch):
    ran = []

    def killed(settings):
        os.kill(os.getpid(), signal.SIGTERM)
        return []

    monkeypatch.setattr(core, "MODULES", ())
    monkeypatch.setattr(core, "REGISTRY", {"killed": killed, "later": lambda s: ran.append(1) or []})
    before = signal.getsignal(signal.SIGTERM)
    assert cli.main(["--quick", "--out", str(tmp_path)]) == 130
    assert ran == [] and signal.getsignal(signal.SIGTERM) is before
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["failures"][0]["error"].startswith("KeyboardInterrupt")


def test_wait_stops_at_the_first_failed_group():
    def job(*codes):
        groups = {g: [SimpleNamespace(proc=SimpleNamespace(poll=lambda c=c: c))] for g, c in enumerate(codes)}
        return SimpleNamespace(groups=groups, workdir="w", tails=lambda: "tails")

    jobs.wait_all_or_first_failure(job(0, 0), timeout_s=1)
    with pytest.raises(RuntimeError, match="exit codes {0: 1, 1: None}"):
        jobs.wait_all_or_first_failure(job(1, None), timeout_s=30)
    with pytest.raises(TimeoutError, match="still running"):
        jobs.wait_all_or_first_failure(job(0, None), timeout_s=0.3, poll_s=0.05)


def test_a_window_rate_counts_commits_and_the_share_with_every_group():
    from ftbridge.harness.bench.straggler import window_rate
    steps = [{"time": t, "committed": c, "participants": p}
             for t, c, p in [(0.5, True, 2), (1.0, True, 1), (1.5, False, 2), (2.5, True, 2), (4.0, True, 2)]]
    assert window_rate(steps, 0.0, 4.0) == {"rate": 0.75, "together": 2 / 3}
    assert window_rate(steps, 3.0, 3.5) == {"rate": 0.0, "together": 0.0}
    with pytest.raises(ValueError, match="empty"):
        window_rate(steps, 2.0, 2.0)
