"""bf16 payload: half the bytes, fp32's range, 8 significant bits.

PyTorch DDP: ``model.register_comm_hook(pg, default_hooks.bf16_compress_hook)``.
Run: ``python examples/bf16.py``.
"""

from common import run

run(__file__, {"comm_hook": "bf16"})
