"""docs/your-script.md shows examples/minimal.py as it is: every line of its ```python blocks is in the file
(```py blocks are sketches of other loops)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_how_to_quotes_the_example_as_it_is():
    doc = (ROOT / "docs" / "your-script.md").read_text()
    example = (ROOT / "examples" / "minimal.py").read_text().splitlines()
    blocks = re.findall(r"```python\n(.*?)```", doc, flags=re.S)
    assert blocks, "the how-to shows the training function"
    missing = [line for block in blocks for line in block.splitlines() if line.strip() and line not in example]
    assert not missing, f"lines in docs/your-script.md that examples/minimal.py no longer has: {missing}"
