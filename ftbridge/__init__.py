"""ftbridge: fault-tolerant DeepSpeed ZeRO training across torchft replica groups.

Public API: :func:`initialize` (mirrors ``deepspeed.initialize``),
:class:`FaultTolerantEngine`, :class:`FTBridgeConfig`.
"""

from ftbridge.config import FTBridgeConfig
from ftbridge.engine import FaultTolerantEngine, initialize

__all__ = ["FTBridgeConfig", "FaultTolerantEngine", "initialize"]
__version__ = "0.1.0"
