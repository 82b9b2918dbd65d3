"""docs/cli.md is what the tools' parsers print (scripts/build_cli_docs.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _builder():
    spec = importlib.util.spec_from_file_location("build_cli_docs", ROOT / "scripts" / "build_cli_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(120)
def test_the_cli_reference_is_what_the_parsers_print():
    builder = _builder()
    assert (ROOT / "docs" / "cli.md").read_text() == builder.render(), (
        "docs/cli.md is out of date: run python scripts/build_cli_docs.py")


@pytest.mark.timeout(120)
def test_a_flag_added_to_a_parser_shows_up_as_a_stale_page(monkeypatch):
    builder = _builder()

    def build(module):
        parser = importlib.import_module(module).build_parser()
        if module == "ftbridge.harness.chaos.cli":
            parser.add_argument("--new-flag", help="not in the page yet")
        return parser

    text = builder.render(build)
    assert "--new-flag" in text and text != (ROOT / "docs" / "cli.md").read_text()
    monkeypatch.setenv("FTBRIDGE_LIGHTHOUSE", "http://elsewhere:1")  # defaults read from the environment:
    assert builder.render() == (ROOT / "docs" / "cli.md").read_text()  # the page does not depend on it
