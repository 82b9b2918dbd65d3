"""PowerSGD inside an fp16 cast: P, Q and the uncompressed elements travel in fp16.

PyTorch DDP::

    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=5)
    model.register_comm_hook(state, default_hooks.fp16_compress_wrapper(powerSGD_hook.powerSGD_hook))

Run: ``python examples/power_sgd_fp16_wrapper.py`` (``"comm_wrapper": "bf16"`` for bf16).
"""

from common import run

run(__file__, {"comm_hook": "power_sgd", "comm_wrapper": "fp16",
               "comm_state_option": {"matrix_approximation_rank": 2, "start_powerSGD_iter": 5}})
