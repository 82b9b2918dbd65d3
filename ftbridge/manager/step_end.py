"""The donor's forward-consumed state at the end of a heal step, relayed to its joiners through the quorum's store.

A heal carries what users registered ``at_step_start`` (:mod:`ftbridge.heal.extra`: the random generators)
as the donor read it at the start of the step. A joiner that healed mid-step (its forward ran on its own
state) would continue from there, one step behind the donor, whose forward has since consumed the step's
draws. So in a heal step each donor rank writes those entries as they stand right before its commit vote
(:meth:`StepEndRelay.publish`), and each joiner rank, once its heal is applied and the step committed,
reads its donor's (:meth:`StepEndRelay.fetch`). The donor writes before it enters the vote's all-reduce,
which a joiner leaves only after every member added its row, so a joiner that got that far finds the key
without waiting. Why: ``docs/heal.md``, "What a heal carries".

Keys live on the quorum's store (the primary's, as torchft's process group and the commit vote use), under
``ftbridge/step_end/{quorum id}/{step}/{group rank}/{replica rank}``; a donor deletes its previous key when
it writes the next. Every store call is bounded; a failure is logged and leaves the joiner with the state
the heal carried (one step behind), never a discarded step.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any, Callable, Optional, Tuple

from ftbridge.manager.futures import call_bounded
from ftbridge.manager.torchft_api import create_store_client

logger = logging.getLogger(__name__)

MAX_STEP_END_BYTES = 16 << 20
"""Largest body relayed: the random generators of a process are tens of KB; a larger body is not written, and
one read larger is refused."""

PREFIX = "ftbridge/step_end"


def _key(result: Any, group_rank: int, replica_rank: int) -> str:
    return f"{int(result.quorum_id)}/{int(result.max_step)}/{group_rank}/{replica_rank}"


def donates(result: Any) -> bool:
    """Whether this rank is a heal donor in the quorum ``result`` (torchft's ``QuorumResult``)."""
    return bool(getattr(result, "recover_dst_replica_ranks", None))


def source(result: Any) -> Optional[int]:
    """The replica rank this rank heals from in ``result``, ``None`` when it heals nothing."""
    src = getattr(result, "recover_src_replica_rank", None)
    return int(src) if bool(getattr(result, "heal", False)) and src is not None else None


class StepEndRelay:
    """One rank's side of the relay: writes as a donor, reads as a joiner.

    Args:
        group_rank: this rank's rank inside its replica group (keys are per group rank: rank ``k`` of a joiner
            heals from rank ``k`` of its donor).
        timeout: bound on each store call (connect included): ``FTBridgeConfig.store_call_timeout``, half the
            cross-replica timeout, so that a donor's write on a slow store leaves its peers' vote time to finish.
        connect: ``(store address with prefix, timeout) -> store client``; torchft's ``create_store_client``.
    """

    def __init__(self, group_rank: int, timeout: timedelta,
                 connect: Callable[[str, timedelta], Any] = create_store_client) -> None:
        self._group_rank, self._timeout, self._connect = group_rank, timeout, connect
        self._last: Optional[Tuple[str, str]] = None  # (store address, key) of this rank's last write

    def _store(self, result: Any) -> Any:
        return self._connect(f"{result.store_address}/{PREFIX}", self._timeout)

    def publish(self, result: Any, body: Callable[[], bytes]) -> bool:
        """As a donor in ``result``'s quorum: write ``body()`` under this rank's key. Never raises.

        Returns:
            Whether it was written (``False``: not a donor, the body is over :data:`MAX_STEP_END_BYTES`, or the
            store failed or did not answer within the timeout; the last two are logged).
        """
        if result is None or not donates(result):
            return False
        key = _key(result, self._group_rank, int(result.replica_rank))
        try:
            data = body()
            if len(data) > MAX_STEP_END_BYTES:
                logger.warning("heal step %d: the state registered at_step_start is %d bytes, over %d: joiners keep "
                               "the state read at the step's start", int(result.max_step), len(data),
                               MAX_STEP_END_BYTES)
                return False
            last = self._last

            def write() -> None:
                store = self._store(result)
                store.set(key, data)
                if last is not None and last[0] == result.store_address and last[1] != key:
                    store.delete_key(last[1])

            call_bounded(write, self._timeout, f"the quorum's store {result.store_address}")
            self._last = (str(result.store_address), key)
            return True
        except Exception as exc:  # noqa: BLE001 - the joiners fall back to the state read at the step's start
            logger.warning("heal step %d: the donor's state at the step's end was not written (%s: %s); its "
                           "joiners keep the state read at the step's start", int(result.max_step),
                           type(exc).__name__, exc)
            return False

    def fetch(self, result: Any) -> Optional[bytes]:
        """As a joiner in ``result``'s quorum, after the step's vote: the donor's body, or ``None`` (not a joiner,
        no key, over :data:`MAX_STEP_END_BYTES`, or a store failure, logged). Never raises, never waits for the key.
        """
        src = None if result is None else source(result)
        if src is None:
            return None
        key = _key(result, self._group_rank, src)

        def read() -> Optional[bytes]:
            store = self._store(result)
            return bytes(store.get(key)) if store.check([key]) else None

        try:
            data = call_bounded(read, self._timeout, f"the quorum's store {result.store_address}")
        except Exception as exc:  # noqa: BLE001 - keep the state the heal carried
            logger.warning("heal step %d: the donor's state at the step's end could not be read (%s: %s); this "
                           "rank continues from the state read at the step's start", int(result.max_step),
                           type(exc).__name__, exc)
            return None
        if data is None:
            logger.info("heal step %d: the donor wrote no state at the step's end (not registered there, or "
                        "its write failed): this rank continues from the state read at the step's start",
                        int(result.max_step))
        elif len(data) > MAX_STEP_END_BYTES:
            logger.warning("heal step %d: the donor's state at the step's end is %d bytes, over %d: ignored",
                           int(result.max_step), len(data), MAX_STEP_END_BYTES)
            return None
        return data
