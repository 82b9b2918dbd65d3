"""Batched PowerSGD: the whole partition as one square matrix (cheapest to compute, coarsest).

PyTorch DDP::

    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=5)
    model.register_comm_hook(state, powerSGD_hook.batched_powerSGD_hook)

Run: ``python examples/batched_power_sgd.py``.
"""

from common import run

run(__file__, {"comm_hook": "batched_power_sgd",
               "comm_state_option": {"matrix_approximation_rank": 4, "start_powerSGD_iter": 5}})
