"""Bad values for every valued flag of the command-line tools: a usage error (exit 2) naming the flag, or
accepted; never a traceback, and nothing started."""

from __future__ import annotations

import argparse
from typing import List, Tuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

BAD = ["nan", "inf", "-inf", "-1", "0", "-0.5", "abc", "", "1e400", "0x10", "2.5", " 3", "１", "--", "{}", "None"]
"""Values a hurried user or a broken wrapper script passes."""


def _valued_flags(parser: argparse.ArgumentParser) -> List[str]:
    """The first option string of every flag that takes one value (subcommands' flags not included)."""
    return [a.option_strings[0] for a in parser._actions
            if a.option_strings and a.nargs is None and not isinstance(a, argparse._HelpAction)
            and a.const is None and not isinstance(a, argparse._StoreConstAction)]


def _run_flags() -> List[str]:
    from ftbridge.launch.run import build_parser

    return _valued_flags(build_parser())


GROUP = ["--replica-group-id", "0", "--num-replica-groups", "2", "--nproc-per-node", "1"]


def _with(argv: List[str], flag: str, value: str) -> List[str]:
    out, i = [], 0
    while i < len(argv):  # drop the flag's default value from the base arguments
        if argv[i] == flag:
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return [*out, f"{flag}={value}"]


@given(data=st.data())
@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_ftbridge_run_answers_a_bad_value_with_a_usage_error_naming_the_flag(data, monkeypatch_session):
    from ftbridge.launch import run as launcher

    flag = data.draw(st.sampled_from(_run_flags()))
    value = data.draw(st.sampled_from(BAD))
    argv = [*_with(GROUP, flag, value), "--no-lighthouse-check", "--", __file__]
    rc, err = monkeypatch_session(launcher, argv)
    assert rc in (0, 2), (argv, rc, err)
    if rc == 2:
        assert flag in err or flag.lstrip("-").replace("-", "_") in err, (argv, err)
    assert "Traceback" not in err


@pytest.fixture
def monkeypatch_session(monkeypatch, capsys):
    """Run ``launcher.main(argv)`` with torchrun replaced: ``(exit code, stderr)``; nothing is started."""
    started: List[Tuple[list, dict]] = []

    def run(launcher, argv):
        monkeypatch.setattr(launcher, "run_torchrun", lambda a, env, **kw: started.append((a, env)) or 0)
        for var in [k for k in __import__("os").environ if k.startswith(("FTBRIDGE_", "TORCHFT_"))]:
            monkeypatch.delenv(var)
        capsys.readouterr()
        rc = launcher.main(argv)
        return rc, capsys.readouterr().err

    return run


@pytest.mark.parametrize("tool", ["chaos", "bench", "lighthouse serve", "lighthouse status", "ckpt"])
def test_the_other_tools_answer_every_bad_value_with_a_usage_error_or_accept_it(tool, capsys):
    if tool == "chaos":
        from ftbridge.harness.chaos.cli import build_parser, parse_args
        parser, parse, prefix = build_parser(), parse_args, []
    elif tool == "bench":
        from ftbridge.harness.bench.cli import build_parser
        from ftbridge.harness.bench.cli import parse as bench_parse
        parser, parse, prefix = build_parser(), bench_parse, []
    elif tool == "ckpt":
        from ftbridge.checkpoint.cli import build_parser
        parser = build_parser()
        parse, prefix = parser.parse_args, ["list"]
    else:
        from lighthouse.cli import build_parser
        sub = tool.split()[1]
        top = build_parser()
        parser = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction)).choices[sub]
        parse, prefix = top.parse_args, [sub]
    tail = ["dir"] if tool == "ckpt" else []
    for flag in _valued_flags(parser):
        for value in BAD:
            argv = ([f"{flag}={value}", *prefix, *tail] if tool == "ckpt"
                    else [*prefix, f"{flag}={value}", *tail])
            try:
                parse(argv)
            except SystemExit as exc:
                err = capsys.readouterr().err
                assert exc.code == 2, (argv, err)
                assert flag in err, (argv, err)
