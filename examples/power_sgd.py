"""PowerSGD (Vogels et al., NeurIPS 2019): rank-r factors of each weight fragment of the partition.

PyTorch DDP::

    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=5)
    model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)

Run: ``python examples/power_sgd.py``.
"""

from common import run

run(__file__, {"comm_hook": "power_sgd",
               "comm_state_option": {"matrix_approximation_rank": 2, "start_powerSGD_iter": 5}})
