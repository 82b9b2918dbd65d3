"""Fixed-size replica-group checkpoints (``docs/checkpoints.md``).

:mod:`.writer` (who writes), :mod:`.manifest` (hashes, bounded reads, atomic publish), :mod:`.store`
(list, newest valid, keep K, compatibility), :mod:`.async_save`, :mod:`.group_io` (DeepSpeed save and
load of one group), :mod:`.safe_load`, :mod:`.verified_read`, :mod:`.checkpointer` (schedule,
SIGTERM, resume), :mod:`.cli` (``ftbridge-ckpt``).
"""

from ftbridge.checkpoint.store import (
    CheckpointStore,
    GroupSizeMismatchError,
    NoValidCheckpointError,
    SlotsMismatchError,
    check_compatible,
)
from ftbridge.checkpoint.writer import is_writer, replica_ranks, save_due

__all__ = ["CheckpointStore", "GroupSizeMismatchError", "NoValidCheckpointError", "SlotsMismatchError",
           "check_compatible",
           "is_writer", "replica_ranks", "save_due"]
