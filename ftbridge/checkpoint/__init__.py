"""Fixed-size replica-group checkpoints (see ``docs/checkpoints.md``).

One module per idea: :mod:`.writer` (who writes: a pure function of the
quorum), :mod:`.manifest` (sizes, SHA-256, atomic publish), :mod:`.store`
(list, newest valid, keep K, compatibility), :mod:`.async_save` (CPU snapshot
and background write), :mod:`.group_io` (DeepSpeed save/load of one group),
:mod:`.checkpointer` (schedule, SIGTERM, resume for a
:class:`~ftbridge.engine.FaultTolerantEngine`), :mod:`.cli` (``ftbridge-ckpt``).
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
