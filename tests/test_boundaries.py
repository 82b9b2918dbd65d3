"""The import graph: which modules may import torchft and DeepSpeed internals (issue 13; docs/concepts.md).

Reads the ``import`` statements of ``ftbridge/``, ``lighthouse/`` and ``scripts/`` with ``ast``. A module
that is not listed here and imports torchft, or a DeepSpeed module below ``deepspeed.runtime``/``utils``,
fails this test: go through the door (:mod:`ftbridge.manager.torchft_api`, :mod:`ftbridge.zero`) instead, or move
the door and update the diagram in docs/concepts.md together with these sets. The job and test harness
(``ftbridge/harness/``) sits on top: the runtime and ``lighthouse/`` never import it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, Set

REPO = Path(__file__).resolve().parents[1]

TORCHFT_DOORS = {"ftbridge/manager/torchft_api.py"}
"""The one module that imports torchft; everything else (the manager package's process groups and heal
transport, the lighthouse service) takes torchft's names from it."""

MANAGER_PACKAGE = "ftbridge/manager/"
"""Where :class:`ftbridge.manager.ReplicaManager`'s torchft ``Manager`` (``_torchft``) may be touched."""

DEEPSPEED_INTERNAL_DOORS = {"ftbridge/zero/"}
"""Where DeepSpeed names other than ``deepspeed`` itself and ``deepspeed.accelerator`` may be imported."""


def _imports() -> Dict[str, Set[str]]:
    found: Dict[str, Set[str]] = {}
    for top in ("ftbridge", "lighthouse", "scripts"):
        for path in sorted((REPO / top).rglob("*.py")):
            names: Set[str] = set()
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    names.update(a.name for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    names.add(node.module)
            found[str(path.relative_to(REPO))] = names
    return found


def _allowed(path: str, doors: Set[str]) -> bool:
    return any(path == d or (d.endswith("/") and path.startswith(d)) for d in doors)


def test_torchft_is_imported_only_through_its_doors():
    bad = {p: sorted(n for n in names if n.split(".")[0] == "torchft")
           for p, names in _imports().items() if not _allowed(p, TORCHFT_DOORS)}
    assert not {p: n for p, n in bad.items() if n}, "import torchft through ftbridge.manager.torchft_api"


def test_the_torchft_door_is_the_one_module_that_imports_torchft():
    # docs/concepts.md says "torchft is imported by one module": the door must really be it, not a stale name.
    importers = {p for p, names in _imports().items() if any(n.split(".")[0] == "torchft" for n in names)}
    assert importers == TORCHFT_DOORS


def test_deepspeed_internals_are_imported_only_through_zero():
    public = {"deepspeed", "deepspeed.accelerator"}
    bad = {p: sorted(n for n in names if n.split(".")[0] == "deepspeed" and n not in public)
           for p, names in _imports().items() if not _allowed(p, DEEPSPEED_INTERNAL_DOORS)}
    assert not {p: n for p, n in bad.items() if n}, "read DeepSpeed internals through ftbridge.zero"


def test_no_module_reaches_the_torchft_manager_around_replica_manager():
    reached = []
    for top in ("ftbridge", "lighthouse", "scripts"):
        for path in sorted((REPO / top).rglob("*.py")):
            rel = str(path.relative_to(REPO))
            if _allowed(rel, {MANAGER_PACKAGE}):
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Attribute) and node.attr in ("torchft", "_torchft"):
                    reached.append(f"{rel}:{node.lineno}")
    assert not reached, f"use ReplicaManager's methods instead of its torchft Manager: {reached}"


HARNESS = "ftbridge.harness"
"""The job and test harness (issue 13 item 5): it imports the runtime and the lighthouse, never the reverse."""


def _harness_references(tree: ast.AST) -> Set[str]:
    """Every way ``tree`` can reach the harness: ``import``/``from`` (``from ftbridge import harness`` too) and
    a string that is exactly a harness module's name (``importlib.import_module``, ``python -m``)."""
    names: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"[\w.]+", node.value):
            names.add(node.value)
    return {n for n in names if n == HARNESS or n.startswith(HARNESS + ".")}


def test_the_runtime_and_the_lighthouse_never_import_the_harness():
    paths = [p for top in ("ftbridge", "lighthouse") for p in sorted((REPO / top).rglob("*.py"))
             if not p.relative_to(REPO).as_posix().startswith("ftbridge/harness/")]
    assert len(paths) > 40 and REPO / "ftbridge" / "engine.py" in paths and REPO / "lighthouse" / "cli.py" in paths
    bad = {str(p.relative_to(REPO)): sorted(_harness_references(ast.parse(p.read_text(encoding="utf-8"))))
           for p in paths}
    assert not {p: n for p, n in bad.items() if n}, "the runtime and lighthouse/ must not import ftbridge.harness"


def test_the_runtime_never_imports_the_lighthouse_service():
    # The layers go one way: harness -> lighthouse/ -> runtime. The runtime reads a lighthouse through
    # ftbridge.manager.lighthouse_status and starts none; lighthouse/ builds its service on the runtime's parts.
    runtime = {p: names for p, names in _imports().items()
               if p.startswith("ftbridge/") and not p.startswith("ftbridge/harness/")}
    assert len(runtime) > 40 and "ftbridge/manager/quorum_watch.py" in runtime
    bad = {p: sorted(n for n in names if n.split(".")[0] == "lighthouse") for p, names in runtime.items()}
    assert not {p: n for p, n in bad.items() if n}, "the runtime must not import lighthouse/"


def test_the_lighthouse_and_scripts_use_only_public_ftbridge_modules():
    private = {p: sorted(n for n in names if n.startswith("ftbridge") and any(s.startswith("_") for s in n.split(".")))
               for p, names in _imports().items() if not p.startswith("ftbridge/")}
    assert not {p: n for p, n in private.items() if n}, "import public ftbridge modules only (no _private ones)"


LAUNCH_LEAVES = {"ftbridge.launch.cli_types", "ftbridge.launch.build_lock"}
"""The two modules of ``ftbridge/launch/`` that the rest of the code may import: they import nothing from
ftbridge, so no import cycle runs through the launch package (docs/concepts.md)."""


def test_the_runtime_takes_only_the_launch_leaves_and_they_import_nothing_from_ftbridge():
    found = _imports()
    runtime = {p: names for p, names in found.items()
               if p.startswith("ftbridge/") and not p.startswith(("ftbridge/harness/", "ftbridge/launch/"))}
    assert "ftbridge/bootstrap.py" in runtime and "ftbridge.launch.build_lock" in runtime["ftbridge/bootstrap.py"]
    bad = {p: sorted(n for n in names if n.startswith("ftbridge.launch") and n not in LAUNCH_LEAVES)
           for p, names in runtime.items()}
    assert not {p: n for p, n in bad.items() if n}, "the runtime may import only the launch package's leaves"
    for leaf in LAUNCH_LEAVES:
        path = leaf.replace(".", "/") + ".py"
        own = {n for n in found[path] if n.split(".")[0] == "ftbridge"}
        assert not own, f"{path} must import nothing from ftbridge, imports {sorted(own)}"
