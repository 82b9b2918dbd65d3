"""fp16 payload: half the bytes; the partition is divided by the participants before the cast.

PyTorch DDP: ``model.register_comm_hook(pg, default_hooks.fp16_compress_hook)``.
Run: ``python examples/fp16.py``.
"""

from common import run

run(__file__, {"comm_hook": "fp16"})
