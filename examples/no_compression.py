"""Plain average across replica groups (the default): the baseline every hook is compared to.

PyTorch DDP: ``model.register_comm_hook(None, default_hooks.allreduce_hook)``.
Run: ``python examples/no_compression.py`` (a whole 2-group job on this machine).
"""

from common import run

run(__file__, {"comm_hook": "no"})
