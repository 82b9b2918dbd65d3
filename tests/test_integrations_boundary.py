"""Hugging Face packages are imported by ``ftbridge/integrations/`` only, and never by ``import ftbridge``.

The runtime must work without the ``hf`` extra: a module outside the integrations that imports Accelerate,
Transformers or their hub client fails this test.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.test_boundaries import REPO, _imports

HF_PACKAGES = {"accelerate", "transformers", "huggingface_hub", "datasets", "peft", "trl", "tokenizers"}
INTEGRATIONS = "ftbridge/integrations/"


def test_hugging_face_packages_are_imported_only_by_the_integrations():
    found = _imports()
    bad = {p: sorted(n for n in names if n.split(".")[0] in HF_PACKAGES)
           for p, names in found.items() if not p.startswith(INTEGRATIONS)}
    assert not {p: n for p, n in bad.items() if n}, "import Hugging Face packages in ftbridge/integrations/ only"
    assert "accelerate" in found["ftbridge/integrations/accelerate.py"], "the door is the module that imports it"
    assert "transformers" in found["ftbridge/integrations/transformers.py"]


@pytest.mark.timeout(120)
def test_importing_ftbridge_and_its_engine_imports_no_hugging_face_package():
    code = ("import sys, ftbridge, ftbridge.bootstrap, ftbridge.engine; "
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {sorted(HF_PACKAGES)!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100, check=False,
                         cwd=str(REPO))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
