"""Every relative link in the README and ``docs/`` reaches a file, and every ``#anchor`` a heading there.

Anchors follow GitHub's rule for headings: lower case, characters other than letters, digits,
``_``, ``-`` and spaces dropped, spaces turned into ``-``. Fenced code blocks are skipped.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading's text (the ``#`` marks already removed)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> Set[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return {github_anchor(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def broken_links(page: Path) -> List[Tuple[str, str]]:
    """``(link, why)`` for each relative link of ``page`` that leads nowhere."""
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    out = []
    for link in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", link):  # http:, https:, mailto:
            continue
        path, _, fragment = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            out.append((link, f"no file {target.relative_to(ROOT) if target.is_relative_to(ROOT) else target}"))
        elif fragment and target.suffix == ".md" and fragment not in anchors(target):
            out.append((link, f"no heading with anchor #{fragment} in {target.name}"))
    return out


def test_github_anchor_follows_githubs_rule():
    assert github_anchor("10. `spare`: warm spare (full capacity ≤ 1 s)") == "10-spare-warm-spare-full-capacity--1-s"
    assert github_anchor("The commit protocol") == "the-commit-protocol"


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_relative_link_and_anchor_resolves(page):
    assert broken_links(page) == []
