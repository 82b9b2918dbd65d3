"""ftbridge: fault-tolerant DeepSpeed ZeRO training across torchft replica groups.

Public API: :func:`initialize` (mirrors ``deepspeed.initialize``),
:class:`FaultTolerantEngine`, :class:`FTBridgeConfig`. The engine pieces are
imported lazily so that light tools (the launcher) do not import DeepSpeed.
"""

import os
import shutil
import sys
import time
from typing import Any

# DeepSpeed JIT-builds a small op (deepspeed_shm_comm, ~30 s) into TORCH_EXTENSIONS_DIR. The shared
# default (~/.cache/torch_extensions) is rebuilt whenever another venv built it last (its build files
# hold absolute site-packages paths), so each environment gets its own cache; scripts/setup.sh fills it.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
# torch runs the build with the `ninja` first on PATH. A virtual environment has its own (pip's ninja, a
# DeepSpeed dependency) besides any system one, and two ninja versions read each other's build log as a
# changed command: each process whose PATH found the other one rebuilt the op (seen alternating between
# ninja 1.11 and 1.13 here, ~35 s behind a lock each time). Every ftbridge process uses this environment's.
_ninja = os.path.join(os.path.dirname(sys.executable), "ninja")
if os.path.exists(_ninja) and shutil.which("ninja") != _ninja:
    os.environ["PATH"] = os.path.dirname(_ninja) + os.pathsep + os.environ.get("PATH", "")

from ftbridge.build_lock import clear_stale_build_locks, watch_build_locks  # noqa: E402 - after the env above
from ftbridge.config import FTBridgeConfig  # noqa: E402

# A rank killed while it held the JIT build lock would make every later DeepSpeed start wait forever.
clear_stale_build_locks(os.environ["TORCH_EXTENSIONS_DIR"])
watch_build_locks(os.environ["TORCH_EXTENSIONS_DIR"])

IMPORTED_AT = time.time()
"""When this process imported ftbridge (s since the epoch): after any predecessor of a restarted group died."""

__all__ = ["FTBridgeConfig", "FaultTolerantEngine", "initialize"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "initialize":
        from ftbridge import bootstrap

        return bootstrap.initialize
    if name == "FaultTolerantEngine":
        from ftbridge import engine

        return engine.FaultTolerantEngine
    raise AttributeError(f"module 'ftbridge' has no attribute {name!r}")
