"""Convert DeepSpeed state dicts to and from a pickle-free wire form (:func:`to_wire`, :func:`from_wire`).

The donor sends only tensors and JSON scalars; the joiner rebuilds the structure from its own
state dict (same group size and ZeRO stage, so same shapes), keeping its own objects except
loss scalers, whose scalar attributes are sent and set. See docs/concepts.md, "Heal".
"""

from __future__ import annotations

import copy
import enum
from typing import Any

import torch

_SCALARS = (bool, int, float, str, type(None))
_ATTRS = "__attrs__"


def _is_scaler(obj: Any) -> bool:
    return hasattr(obj, "cur_scale") and hasattr(obj, "__dict__")


def to_wire(obj: Any) -> Any:
    """Nested dict of tensors and JSON scalars carrying ``obj``'s state.

    Dicts keep their keys (as ``str``), lists and tuples become dicts keyed
    ``"0"``, ``"1"``, ...; enums become their value; loss scalers become
    ``{"__attrs__": {...}}``; other objects are dropped (returned as ``None``
    and omitted from their parent).
    """
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, enum.Enum):
        return obj.value if isinstance(obj.value, _SCALARS) else None
    if isinstance(obj, _SCALARS):
        return obj
    if isinstance(obj, (dict, list, tuple)):
        pairs = obj.items() if isinstance(obj, dict) else enumerate(obj)
        out = {}
        for k, v in pairs:
            w = to_wire(v)
            if w is not None or v is None:
                out[str(k)] = w
        return out
    if _is_scaler(obj):
        return {_ATTRS: {k: v for k, v in vars(obj).items() if isinstance(v, _SCALARS)}}
    return None


def from_wire(local: Any, wire: Any, path: str = "") -> Any:
    """Rebuild ``local``'s structure with the peer's values from ``wire``.

    Args:
        local: this rank's own state (e.g. ``optimizer.state_dict()``).
        wire: the peer's :func:`to_wire` output, decoded.
        path: key path for error messages.

    Returns:
        A structure like ``local``: the peer's tensors (cast to the local dtype and device) and
        scalars, local objects (loss scalers updated with the peer's attributes); keys only the
        peer has (lazily created optimizer state) are taken from it, digit-only keys as ``int``.

    Raises:
        ValueError: a key or tensor of ``local`` missing in ``wire``, or a differing tensor shape.
    """
    where = path or "<root>"
    if isinstance(local, torch.Tensor):
        if not isinstance(wire, torch.Tensor):
            raise ValueError(f"heal state {where}: expected a tensor, got {type(wire).__name__}")
        if tuple(wire.shape) != tuple(local.shape):
            raise ValueError(
                f"heal state {where}: peer shape {tuple(wire.shape)} != local shape {tuple(local.shape)}; "
                "donor and joiner must have the same group size, ZeRO stage and model"
            )
        return wire.to(device=local.device, dtype=local.dtype)
    if isinstance(local, enum.Enum):
        return type(local)(wire) if wire is not None else local
    if isinstance(local, _SCALARS):
        return wire
    if isinstance(local, dict):
        _check_keys({str(k) for k in local}, wire, where, skip={str(k) for k, v in local.items() if _dropped(v)})
        out = copy.copy(local)
        for k, v in local.items():
            if str(k) in wire:
                out[k] = from_wire(v, wire[str(k)], f"{path}/{k}")
        local_keys = {str(k) for k in local}
        for k, v in wire.items():
            # State the joiner does not have yet (e.g. Adam moments before its first step):
            # take the peer's, with integer keys restored (torch optimizers key state by param index).
            if k not in local_keys:
                out[int(k) if k.isdigit() else k] = _restore_keys(v)
        return out
    if isinstance(local, (list, tuple)):
        _check_keys({str(i) for i in range(len(local))}, wire, where,
                    skip={str(i) for i, v in enumerate(local) if _dropped(v)})
        items = [from_wire(v, wire[str(i)], f"{path}/{i}") if str(i) in wire else v for i, v in enumerate(local)]
        return type(local)(items) if not hasattr(local, "_fields") else type(local)(*items)
    if _is_scaler(local):
        for k, v in (wire or {}).get(_ATTRS, {}).items():
            setattr(local, k, v)
        return local
    return local


def _dropped(value: Any) -> bool:
    return to_wire(value) is None and value is not None


def _check_keys(local_keys: set, wire: Any, where: str, skip: set) -> None:
    if not isinstance(wire, dict):
        raise ValueError(f"heal state {where}: expected a mapping, got {type(wire).__name__}")
    missing = local_keys - set(wire) - skip
    if missing:
        raise ValueError(
            f"heal state {where}: the peer's state lacks {sorted(missing)[:5]}; "
            "donor and joiner must run the same model and config"
        )


def _restore_keys(wire: Any) -> Any:
    if isinstance(wire, dict):
        return {int(k) if k.isdigit() else k: _restore_keys(v) for k, v in wire.items()}
    return wire
