"""Launching replica groups: ``ftbridge-run`` (:mod:`.run`), torchrun under supervision (:mod:`.supervise`),
process helpers (:mod:`.processes`), the TorchX component (:mod:`.torchx`), argparse value types shared by
every command line (:mod:`.cli_types`) and DeepSpeed's JIT build lock (:mod:`.build_lock`).

Nothing here runs at import time; the training runtime does not import this package except for
:func:`.build_lock.prepare_jit_build` (called by :func:`ftbridge.initialize`).
"""
