"""A rank's random number generators as heal state: torch (CPU and every CUDA device), Python's ``random``
and NumPy's global generator.

``engine.ftbridge.register_state("rng", state_dict, load_state_dict, at_step_start=True)`` makes a heal
carry them (the Hugging Face integrations do). Read at the start of a step, they are the state the
donor's forward starts from, which a group that heals before its first forward applies then; one that
heals mid-step takes them again as the donor held them at its commit vote
(:mod:`ftbridge.manager.step_end`). Either way it continues the donor's random stream exactly
(``docs/heal.md``, "What a heal carries")."""

from __future__ import annotations

import random
from typing import Any, Dict

import numpy as np
import torch


def state_dict() -> Dict[str, Any]:
    """This process's generator states: ``torch`` (uint8), ``cuda`` (one uint8 tensor per device, where CUDA is
    available), ``python`` and ``numpy`` (int64 tensors and scalars). Fresh tensors: safe to send as they are."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: Dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {"version": int(version), "internal": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
    }
    if torch.cuda.is_available():
        state["cuda"] = {str(i): s for i, s in enumerate(torch.cuda.get_rng_state_all())}
    return state


def load_state_dict(state: Dict[str, Any]) -> None:
    """Set this process's generators to ``state`` (:func:`state_dict`'s form, e.g. a peer's through a heal).

    Raises:
        ValueError: a CUDA state for a device count other than this process's.
    """
    torch.set_rng_state(state["torch"].to(torch.uint8).cpu())
    if "cuda" in state and torch.cuda.is_available():
        cuda = [state["cuda"][str(i)].to(torch.uint8).cpu() for i in range(len(state["cuda"]))]
        if len(cuda) != torch.cuda.device_count():
            raise ValueError(f"random state for {len(cuda)} CUDA devices, this process sees "
                             f"{torch.cuda.device_count()}: donor and joiner must see the same devices")
        torch.cuda.set_rng_state_all(cuda)
    py = state["python"]
    random.setstate((int(py["version"]), tuple(int(x) for x in py["internal"].tolist()), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state((str(npy["kind"]), npy["keys"].cpu().numpy().astype(np.uint32), int(npy["pos"]),
                         int(npy["has_gauss"]), float(npy["cached_gaussian"])))
