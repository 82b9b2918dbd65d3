"""Your own hook: any ``hook(state, tensor) -> work`` on the flat partition.

Here: log the gradient norm, then average as usual through the managed all-reduce
(``state.allreduce``: fault tolerant, counts bytes, divides by the participants).

PyTorch DDP: ``model.register_comm_hook(state, my_hook)`` with ``my_hook(state, bucket) -> Future``.
Run: ``python examples/custom_hook.py``.
"""

from common import run


def norm_logging_hook(state, tensor):
    if state.step % 10 == 0:
        print(f"step {state.step}: local partition norm {float(tensor.norm()):.4f}, "
              f"{state.participants} participating groups", flush=True)
    return state.allreduce(tensor)


run(__file__, {}, comm_hook=norm_logging_hook)
