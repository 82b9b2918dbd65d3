"""Build the HTML API reference of ftbridge and lighthouse with pdoc.

Usage (from the repository root, in the project's environment)::

    python scripts/build_api_docs.py                 # writes build/api/ (git-ignored); open build/api/index.html
    python scripts/build_api_docs.py -o /tmp/api     # somewhere else

Every module under ``ftbridge/`` and ``lighthouse/`` whose dotted name has no
part starting with ``_`` gets a page (``ftbridge/harness/bench/heal.py`` ->
``ftbridge/harness/bench/heal.html``), docstrings read as Google style (``Args:``,
``Returns:``, ``Raises:``) with reST roles. Each module is imported first: one
that does not import fails the build (exit 1) rather than silently losing its
page, and so does any warning pdoc raises (a name in ``__all__`` that does not
resolve, a docstring it cannot parse).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
import warnings
from pathlib import Path
from typing import List, Optional

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ftbridge", "lighthouse")
DEFAULT_OUT = ROOT / "build" / "api"


def public_modules(root: Path = ROOT) -> List[str]:
    """Dotted names of the modules of :data:`PACKAGES` that get a page, sorted."""
    out = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            if not any(p.startswith("_") for p in parts):
                out.append(".".join(parts))
    return sorted(out)


def page_path(out_dir: Path, module: str) -> Path:
    """Where pdoc writes ``module``'s page under ``out_dir``."""
    return out_dir.joinpath(*module.split(".")).with_suffix(".html")


def build(out_dir: Path) -> List[str]:
    """Write the reference into ``out_dir``; return the documented module names.

    Raises:
        RuntimeError: a module failed to import, pdoc warned, or a module got no page (the message
            lists them all).
    """
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # ftbridge.engine and ftbridge.zero import DeepSpeed
    sys.path.insert(0, str(ROOT))
    import pdoc
    import pdoc.render

    modules = public_modules()
    errors = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - collected: the build reports every module that fails
            errors.append(f"{name} does not import: {type(exc).__name__}: {exc}")
    if errors:
        raise RuntimeError("\n".join(errors))
    # ftbridge exports initialize and FaultTolerantEngine lazily (module __getattr__, so the launcher need
    # not import DeepSpeed); pdoc looks only in the module's __dict__, so resolve them for the build.
    package = sys.modules["ftbridge"]
    for name in package.__all__:
        setattr(package, name, getattr(package, name))
    pdoc.render.configure(docformat="google", show_source=False)  # source: in the repository; halves the build
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pdoc.pdoc(*modules, output_directory=out_dir)
    pdoc_dir = str(Path(pdoc.__file__).parent)
    # Naming a submodule that pdoc also reaches through its package only repeats it: not a problem.
    problems = [f"pdoc: {w.message}" for w in caught if str(w.filename).startswith(pdoc_dir)
                and "has already been added" not in str(w.message)]
    problems += [f"no page for {m} (expected {page_path(out_dir, m)})" for m in modules
                 if not page_path(out_dir, m).is_file()]
    if problems:
        raise RuntimeError("\n".join(problems))
    return modules


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-o", "--out", type=Path, default=DEFAULT_OUT, help="output folder (default build/api)")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    try:
        modules = build(args.out)
    except RuntimeError as exc:
        print(f"API docs not built:\n{exc}", file=sys.stderr)
        return 1
    print(f"API docs: {len(modules)} modules in {args.out} ({time.monotonic() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
