"""DeepSpeed's checkpoint-engine extension point: where ftbridge's checkpoint writers and loaders plug in.

:func:`swapped_checkpoint_engine` replaces ``engine.checkpoint_engine`` (through which DeepSpeed
0.19 reads and writes every checkpoint file) for one save or load with a
:class:`DelegatingCheckpointEngine` whose ``save`` and ``load`` are ftbridge's
(:mod:`ftbridge.checkpoint.async_save`, :mod:`ftbridge.checkpoint.safe_load`).
:data:`DEEPSPEED_CHECKPOINT_TYPES` feeds the ``weights_only`` allowlist. See
docs/checkpoints.md, "How it works".
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, List, Optional

from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

from ftbridge.zero.engine_points import check_deepspeed_version

DEEPSPEED_CHECKPOINT_TYPES: List[Any] = [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]
"""DeepSpeed 0.19 types in its checkpoint files (loss scalers, the ZeRO stage enum,
``fragment_address``)."""


class DelegatingCheckpointEngine(TorchCheckpointEngine):
    """A DeepSpeed checkpoint engine whose ``save`` and ``load`` are the given functions.

    Args:
        name: shown by DeepSpeed in its logs (``engine.checkpoint_engine.name``).
        save: ``save(state_dict, path)``; ``None``: DeepSpeed's own ``torch.save``.
        load: ``load(path, map_location) -> object``; ``None``: refuse (this engine only saves).
        zipfile_serialization: the torch.save format of DeepSpeed's own engine.
    """

    def __init__(self, name: str, *, save: Optional[Callable[[Any, str], None]] = None,
                 load: Optional[Callable[[str, Any], Any]] = None, zipfile_serialization: bool = True) -> None:
        super().__init__(None)
        self.name = name
        self.zipfile_serialization = zipfile_serialization
        self._save, self._load = save, load

    def create(self, info: Any) -> None:
        """Nothing to prepare (DeepSpeed calls it before the first file)."""

    def save(self, state_dict: Any, path: str) -> None:
        """Write one file of the checkpoint."""
        if self._save is None:
            super().save(state_dict, path)
        else:
            self._save(state_dict, path)

    def load(self, path: str, map_location: Any = None) -> Any:
        """Read one file of the checkpoint.

        Raises:
            RuntimeError: this engine was made without a loader.
        """
        if self._load is None:
            raise RuntimeError(f"{self.name} only saves; it cannot load {path}")
        return self._load(path, map_location)


def zipfile_serialization(ds_engine: Any) -> bool:
    """The torch.save format of the engine's current checkpoint engine (so ftbridge's files match DeepSpeed's)."""
    return bool(getattr(getattr(ds_engine, "checkpoint_engine", None), "zipfile_serialization", True))


def loads_universal(ds_engine: Any) -> bool:
    """Whether the engine is configured to load universal checkpoints (``"checkpoint": {"load_universal": true}``)."""
    return bool(ds_engine.load_universal_checkpoint())


@contextlib.contextmanager
def swapped_checkpoint_engine(ds_engine: Any, engine: TorchCheckpointEngine) -> Iterator[None]:
    """Inside the block, DeepSpeed's ``save_checkpoint``/``load_checkpoint`` go through ``engine``.

    Raises:
        RuntimeError: a DeepSpeed release this was not checked against, or
            an engine without a checkpoint engine.
    """
    check_deepspeed_version()
    previous = getattr(ds_engine, "checkpoint_engine", None)
    if previous is None:
        raise RuntimeError("this DeepSpeed engine has no checkpoint_engine; ftbridge cannot save or load through it")
    ds_engine.checkpoint_engine = engine
    try:
        yield
    finally:
        ds_engine.checkpoint_engine = previous
