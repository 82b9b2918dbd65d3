"""ftbridge: fault-tolerant DeepSpeed ZeRO training across torchft replica groups.

Public API: :func:`initialize` (mirrors ``deepspeed.initialize``),
:class:`FaultTolerantEngine`, :class:`FTBridgeConfig`. The engine pieces are
imported lazily so that light tools (the launcher) do not import DeepSpeed.
"""

from typing import Any

from ftbridge.config import FTBridgeConfig

__all__ = ["FTBridgeConfig", "FaultTolerantEngine", "initialize"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in ("initialize", "FaultTolerantEngine"):
        from ftbridge import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'ftbridge' has no attribute {name!r}")
