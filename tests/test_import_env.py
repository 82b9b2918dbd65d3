"""What ftbridge's entry points set up for DeepSpeed's JIT-built op (its own cache, one ninja for every process),
and that ``import ftbridge`` itself changes nothing."""

from __future__ import annotations

import os
import subprocess
import sys


def _after_import(path: str) -> str:
    code = ("import os, shutil; from ftbridge.launch.build_lock import prepare_jit_build; prepare_jit_build(); "
            "print(os.environ['TORCH_EXTENSIONS_DIR']); print(shutil.which('ninja'))")
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    env["PATH"] = path
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         check=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return out.stdout


def test_every_process_builds_with_this_environments_ninja_whatever_its_path():
    # Two ninja versions (the system's and pip's in the venv) read each other's build log as a changed
    # command and rebuilt the op (~35 s behind a lock) whenever a process with the other PATH came along.
    venv_ninja = os.path.join(os.path.dirname(sys.executable), "ninja")
    if not os.path.exists(venv_ninja):
        import pytest

        pytest.skip(f"this environment has no ninja of its own ({venv_ninja})")
    plain = _after_import("/usr/local/bin:/usr/bin:/bin").splitlines()
    activated = _after_import(os.path.dirname(sys.executable) + ":/usr/bin:/bin").splitlines()
    assert plain[1] == activated[1] == venv_ninja
    assert plain[0] == activated[0] == os.path.join(sys.prefix, "torch_extensions")


def test_ftbridge_ckpt_list_and_inspect_import_neither_torch_nor_deepspeed():
    # `ftbridge-ckpt list` on a login node: no 2.4 s import and no accelerator warning for a folder listing.
    code = ("import sys, ftbridge.checkpoint.cli as c; "
            "print(sorted(m for m in ('torch', 'deepspeed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_importing_ftbridge_changes_nothing_in_the_process():
    code = ("import os, threading; before = (dict(os.environ), threading.active_count()); import ftbridge, "
            "ftbridge.launch.run; print(before == (dict(os.environ), threading.active_count()))")
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    env["PATH"] = "/usr/local/bin:/usr/bin:/bin"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         check=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.stdout.strip() == "True", out.stdout + out.stderr
