"""ftbridge: fault-tolerant DeepSpeed ZeRO training across torchft replica groups.

Public API: :func:`initialize` (mirrors ``deepspeed.initialize``), :func:`attach`
(makes an engine a framework built fault-tolerant in place), :class:`FaultTolerantEngine`,
:class:`FTBridgeConfig`. The engine pieces are
imported lazily so that light tools (the launcher) do not import DeepSpeed. Importing the package
changes nothing in the process: the entry points prepare DeepSpeed's JIT build
(:func:`ftbridge.launch.build_lock.prepare_jit_build`).
"""

import time
from typing import Any

from ftbridge.config import FTBridgeConfig

IMPORTED_AT = time.time()
"""When this process imported ftbridge (s since the epoch): after any predecessor of a restarted group died."""

__all__ = ["FTBridgeConfig", "FaultTolerantEngine", "attach", "initialize"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in ("initialize", "attach"):
        from ftbridge import bootstrap

        return getattr(bootstrap, name)
    if name == "FaultTolerantEngine":
        from ftbridge import engine

        return engine.FaultTolerantEngine
    raise AttributeError(f"module 'ftbridge' has no attribute {name!r}")
