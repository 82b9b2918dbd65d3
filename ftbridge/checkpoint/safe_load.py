"""Loading checkpoint files without running code in them (``docs/checkpoints.md``, "How it works").

:func:`safe_load` is ``torch.load(weights_only=True)`` plus :data:`ALLOWED_GLOBALS`; anything else
raises :class:`UnsafeCheckpointError` naming the file and the type, and no code in it runs.
:func:`load_deepspeed_checkpoint` checks every file first, then runs DeepSpeed's ``load_checkpoint``
with a checkpoint engine that loads through :class:`SafeLoader`; universal checkpoints are refused.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import zipfile
from typing import Any, BinaryIO, Dict, Iterator, List, Optional, Union

import torch
from torch.torch_version import TorchVersion

from ftbridge.checkpoint.async_save import snapshot
from ftbridge.checkpoint.manifest import checkpoint_files
from ftbridge.zero.checkpoint_engines import (
    DEEPSPEED_CHECKPOINT_TYPES,
    DelegatingCheckpointEngine,
    loads_universal,
    swapped_checkpoint_engine,
    zipfile_serialization,
)

ALLOWED_GLOBALS: List[Any] = [*DEEPSPEED_CHECKPOINT_TYPES, TorchVersion]
"""Types beyond torch's defaults: DeepSpeed 0.19's (``DEEPSPEED_CHECKPOINT_TYPES``) and ``TorchVersion``."""

_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")


class UnsafeCheckpointError(ValueError):
    """A checkpoint file needs a type outside the allowlist (or is no torch file); nothing was loaded."""


def safe_load(path: Union[str, BinaryIO], map_location: Any = "cpu", *, mmap: bool = False,
              name: Optional[str] = None) -> Any:
    """``torch.load(path, weights_only=True)`` with :data:`ALLOWED_GLOBALS` allowed.

    Args:
        path: a file written by ``torch.save``, or a binary file object holding one.
        mmap: memory-map tensor storages instead of reading them (zip format only).
        name: the file's name in messages (default: ``path``).

    Raises:
        UnsafeCheckpointError: a type that is not allowed (named), or no torch file; no code in it ran.
        OSError: the file cannot be read.
    """
    try:
        with torch.serialization.safe_globals(ALLOWED_GLOBALS):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, TypeError, AttributeError) as e:
        m = _GLOBAL_RE.search(str(e))
        need = f"type {m.group(1)}, which is not in ftbridge's allowlist" if m else f"no safe torch file ({e!r:.300})"
        raise UnsafeCheckpointError(
            f"refusing to load {name or path}: it needs {need}; nothing was loaded. A checkpoint holds tensors, "
            "numbers, strings, containers and DeepSpeed's own types only; a file naming other functions can run code "
            "when loaded. If you wrote this type yourself and trust the file, allow it with "
            "torch.serialization.add_safe_globals([...]) before resuming.") from None


def check_files(paths: List[str]) -> Dict[str, Any]:
    """``{absolute path: object}`` of ``paths`` loaded with :func:`safe_load`, memory-mapped, for :class:`SafeLoader`.

    Raises :class:`UnsafeCheckpointError` for the first file that needs a type not allowed.
    """
    return {os.path.abspath(p): safe_load(p, "cpu", mmap=zipfile.is_zipfile(p)) for p in paths}


_RANK_FILE_RE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_?(?:optim|model)_states\.pt$"
                           r"|^ftbridge_rank_(\d+)\.pt$")


def files_of_rank(paths: List[str], rank: int, size: int) -> List[str]:
    """The files of ``paths`` that group rank ``rank`` of ``size`` checks: all but those named for another
    rank ``j < size`` (its ZeRO shards and ``ftbridge_rank_<j>.pt``). ValueError if ``rank`` is not in ``[0, size)``.
    """
    if not 0 <= rank < size:
        raise ValueError(f"group rank {rank} is not in [0, {size}): pass dist.get_rank() and dist.get_world_size()")
    keep = []
    for p in paths:
        m = _RANK_FILE_RE.match(os.path.basename(p))
        owner = None if m is None else int(m.group(1) or m.group(2))
        if owner is None or owner == rank or owner >= size:
            keep.append(p)
    return keep


def _to_cpu(map_location: Any) -> bool:
    # DeepSpeed 0.19 loads with map_location 'cpu', torch.device('cpu') or `lambda storage, loc: storage`
    # (which keeps the deserialised CPU storage): a CPU object from check_files is then what it would get.
    return map_location is None or callable(map_location) or str(map_location) == "cpu"


class SafeLoader:
    """The ``load`` of a DeepSpeed checkpoint engine: :func:`safe_load`, serving ``preloaded`` files first.

    A CPU load of a file in ``preloaded`` (:func:`check_files`) gets a fresh in-memory copy, not a re-parse.
    """

    def __init__(self, preloaded: Optional[Dict[str, Any]] = None) -> None:
        self.preloaded = dict(preloaded or {})

    def load(self, path: str, map_location: Any = None) -> Any:
        """DeepSpeed's load of one file, with ``weights_only=True`` and the allowlist."""
        obj = self.preloaded.get(os.path.abspath(path))
        if obj is not None and _to_cpu(map_location):
            # Copy the memory-mapped tensors into memory (views and sharing kept): DeepSpeed and torch's
            # optimizer keep some loaded tensors as state, which must not depend on the file staying intact.
            return snapshot(obj)
        return safe_load(path, map_location)


@contextlib.contextmanager
def safe_deepspeed_loads(ds_engine: Any, preloaded: Optional[Dict[str, Any]] = None) -> Iterator[None]:
    """Inside the block, DeepSpeed's ``load_checkpoint`` reads files only through :func:`safe_load`.

    Raises:
        RuntimeError: an unsupported DeepSpeed release, or an engine without a checkpoint engine.
        ValueError: the engine loads universal checkpoints (DeepSpeed reads those with pickle).
    """
    if loads_universal(ds_engine):
        raise ValueError('"checkpoint": {"load_universal": true} is set: DeepSpeed loads universal checkpoints '
                         "with torch.load(weights_only=False), past ftbridge's safe loader; ftbridge resumes "
                         "replica-group checkpoints only. Remove load_universal from the DeepSpeed config.")
    plugged = DelegatingCheckpointEngine("FTBridgeSafeCheckpointEngine", load=SafeLoader(preloaded).load,
                                         zipfile_serialization=zipfile_serialization(ds_engine))
    with swapped_checkpoint_engine(ds_engine, plugged):
        yield


def load_deepspeed_checkpoint(ds_engine: Any, load_dir: str, tag: Optional[str] = None, *,
                              preloaded: Optional[Dict[str, Any]] = None, **kwargs: Any) -> Any:
    """DeepSpeed's ``load_checkpoint(load_dir, tag, **kwargs)``, every file checked first and loaded safely.

    Args:
        tag: the tag to load; ``None``: the one ``load_dir/latest`` names.
        preloaded: :func:`check_files` of the tag's ``.pt`` files, if the caller has it.

    Returns:
        DeepSpeed's ``(path or None, client_state)``; ``(None, None)`` without ``latest``.

    Raises:
        UnsafeCheckpointError: a file needs a type outside the allowlist; before any state changes.
        ValueError: ``tag`` is not a folder name.
    """
    if tag is None:
        from ftbridge.checkpoint.manifest import read_latest

        tag = read_latest(load_dir)
        if tag is None:
            return None, None
    if os.sep in tag or tag in ("", ".", ".."):
        raise ValueError(f"checkpoint tag {tag!r} is not a folder name inside {load_dir}")
    if preloaded is None:
        preloaded = check_files(checkpoint_files(os.path.join(load_dir, tag)))
    with safe_deepspeed_loads(ds_engine, preloaded):
        return ds_engine.load_checkpoint(load_dir, tag=tag, **kwargs)
