"""Command-line numbers are refused where they are typed: exit 2 with the flag named, no traceback (issue 17, Low)."""

from __future__ import annotations

import argparse
import math

import pytest

from ftbridge.launch.cli_types import at_least, finite, probability

pytestmark = pytest.mark.timeout(60)


def test_at_least_and_finite_refuse_with_the_value():
    assert at_least(1)("3") == 3
    assert probability("0.1") == 0.1 and finite(0.0)("0") == 0.0 and finite(0.0, strictly_above=True)("0.5") == 0.5
    for parse, text, why in [(at_least(1), "0", "below the smallest allowed value, 1"),
                             (at_least(0), "x", "not an integer"),
                             (finite(0.0), "nan", "not a finite number"),
                             (finite(0.0), "inf", "not a finite number"),
                             (finite(0.0), "-1", "at least 0"),
                             (finite(0.0, strictly_above=True), "0", "above 0"),
                             (probability, "1", "below 1"), (probability, "-0.1", "at least 0")]:
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            parse(text)


@pytest.mark.parametrize("flag,value", [("--steps", "-1"), ("--lr", "nan"), ("--grad-accum", "0"),
                                        ("--lr", "inf"), ("--micro-batch", "0"), ("--grad-clip", "-1"),
                                        ("--dropout", "1")])
def test_the_main_job_refuses_bad_numbers_before_it_starts(capsys, flag, value):
    from ftbridge.harness.lm_job import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([flag, value])
    assert e.value.code == 2 and f"argument {flag}" in capsys.readouterr().err
    assert build_parser().parse_args([]).steps >= 1 and math.isfinite(build_parser().parse_args([]).lr)


def test_lighthouse_serve_refuses_bad_numbers(capsys):
    from lighthouse.cli import build_parser

    for argv in (["serve", "--min-replicas", "0"], ["serve", "--probe-interval-s", "nan"]):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(argv)
        assert e.value.code == 2


@pytest.mark.parametrize("prefix", ["--replica-group", "--num-replica", "--nproc-per"])
def test_ftbridge_run_takes_full_flag_names_only_not_prefixes(capsys, prefix):
    from ftbridge.launch.run import parse_args

    full = {"--replica-group-id": "0", "--num-replica-groups": "2", "--nproc-per-node": "1",
            "--lighthouse": "http://127.0.0.1:29510"}
    assert parse_args([*(w for kv in full.items() for w in kv), "--", "train.py"]).nproc_per_node == 1
    argv = [w for k, v in full.items() for w in ((prefix if k.startswith(prefix) else k), v)]
    with pytest.raises(SystemExit) as e:
        parse_args([*argv, "--", "train.py"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and ("unrecognized arguments" in err or "required" in err), err
