"""The generated API reference matches the docstrings it is built from."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_api_reference_is_up_to_date():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gen_api_docs.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"docs/api.md is stale: run python scripts/gen_api_docs.py\n{proc.stdout}{proc.stderr}"
