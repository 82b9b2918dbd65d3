"""The API reference builds with pdoc and has a page for every public module."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _public_modules():
    """Every module of ftbridge/ and lighthouse/ with no ``_``-prefixed part, walked here independently
    of the build script so that a script listing too few modules fails this test."""
    out = []
    for package in ("ftbridge", "lighthouse"):
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            if not any(p.startswith("_") for p in parts):
                out.append(parts)
    return out


def test_api_reference_builds_a_page_per_public_module(tmp_path):
    out = tmp_path / "api"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_api_docs.py"), "-o", str(out)],
                          capture_output=True, text=True, timeout=300, check=False, env=env, cwd=str(ROOT))
    assert proc.returncode == 0, f"pdoc build failed:\n{proc.stdout}{proc.stderr[-4000:]}"
    modules = _public_modules()
    assert len(modules) > 50 and ["ftbridge", "engine"] in modules and ["lighthouse", "server"] in modules
    missing = [".".join(m) for m in modules if not out.joinpath(*m).with_suffix(".html").is_file()]
    assert missing == [], f"no API page for {missing}"
    # The lazily exported entry points are documented on the package page, with their docstrings.
    top = (out / "ftbridge.html").read_text(encoding="utf-8")
    assert 'id="initialize"' in top and 'id="FaultTolerantEngine"' in top
