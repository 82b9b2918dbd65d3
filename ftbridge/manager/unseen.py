"""Quorums the lighthouse issued to a quorum call this rank gave up on: dead ends only this group can name.

torchft 0.2's lighthouse keeps a quorum request in its table until it issues a quorum, also after the caller
timed out and went away. When a try of this group's call times out, the next quorum the lighthouse forms
before the group's next try arrives still counts this group, and its answer goes nowhere (the lighthouse logs
``failed to send quorum``). Nobody commits in a quorum one of its members never joined (a commit needs every
member's row in the agreement), so it is a dead end; but when this group was alone in it, no member of a later
quorum can say so, and the continuity rule would stop the group for a gap it cannot account for.

:class:`UnseenQuorums` reads the lighthouse's ``/status`` after a try times out and again right before the
next try: a last quorum that holds this group's replica id (torchft's id with this launch's uuid) and that this
rank never received is recorded in its :class:`~ftbridge.manager.history.QuorumHistory` as a dead end. Group
rank 0 shares what it found with the group's other ranks (:mod:`ftbridge.manager.outage`). A quorum that
another quorum replaced before a read is not seen; a read that fails changes nothing (the group is then as
without this module). Why: docs/design.md, "Continuity".
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any, Callable, List, Optional, Sequence

from ftbridge.manager.history import QuorumHistory
from ftbridge.manager.lighthouse_status import LighthouseStatus, StatusFormatError, fetch_status

logger = logging.getLogger(__name__)

READ_TIMEOUT = timedelta(milliseconds=500)
"""Bound on one ``/status`` read (connect and read each)."""

MAX_SHARED = 16
"""Most quorum ids group rank 0 shares for one step (:func:`decode_ids`)."""


def unseen_quorum(previous_id: Optional[int], members: Sequence[str], me: str, last_id: Optional[int]) -> Optional[int]:
    """The lighthouse's last quorum if it was issued to a call of this group that no answer reached (pure).

    Args:
        previous_id: the id of the lighthouse's last quorum (``None``: none yet).
        members: its members' replica ids.
        me: this group's replica id as torchft's lighthouse knows it (``replica_group_G:UUID``).
        last_id: the newest quorum id this rank received (``None``: none; then nothing is unseen).

    Returns:
        ``previous_id`` when it is newer than ``last_id`` and counts ``me``, else ``None``.
    """
    if previous_id is None or last_id is None or previous_id <= last_id:
        return None
    return previous_id if me in members else None


def encode_ids(ids: Sequence[int]) -> bytes:
    """Quorum ids as the ASCII line group rank 0 shares (``b"14 15"``; ``b""`` for none)."""
    return " ".join(str(int(i)) for i in ids[-MAX_SHARED:]).encode()


def decode_ids(raw: bytes) -> List[int]:
    """The ids of :func:`encode_ids`; refuses anything else.

    Raises:
        ValueError: more than :data:`MAX_SHARED` ids, or a word that is not a non-negative integer.
    """
    words = raw.split()
    if len(words) > MAX_SHARED or len(raw) > 24 * MAX_SHARED:
        raise ValueError(f"unseen quorum ids: more than {MAX_SHARED} ids ({len(raw)} bytes)")
    if not all(w.isdigit() for w in words):
        raise ValueError(f"unseen quorum ids: {raw[:80]!r} is not a list of non-negative integers")
    return [int(w) for w in words]


class UnseenQuorums:
    """One rank's reader of the lighthouse's last quorum after a try of its quorum call timed out.

    Args:
        lighthouse: the lighthouse's address (its ``/status`` page is read).
        history: the rank's quorum history; found ids are recorded there as dead ends.
        who: ``[replica G rank R]`` for logs.
        me: returns this group's replica id at the lighthouse (``replica_group_G:UUID``); called once, when first
            needed; may raise (then nothing is looked for, with a warning).
        fetch: reads a :class:`LighthouseStatus` of an address within a timeout in seconds (tests pass a fake).
    """

    def __init__(self, lighthouse: str, history: QuorumHistory, who: str, *, me: Callable[[], str],
                 fetch: Callable[[str, float], LighthouseStatus] = fetch_status) -> None:
        self._lighthouse, self._history, self._who, self._fetch = lighthouse, history, who, fetch
        self._me_of: Optional[Callable[[], str]] = me
        self._me: Optional[str] = None
        self.found: List[int] = []
        """Ids this rank found since :meth:`share` last sent them."""
        self.failed_reads = 0
        """Reads that failed (each changed nothing)."""
        self._logged: Optional[int] = None  # the id last warned about (a read repeated at each try finds it again)

    def _replica_id(self) -> Optional[str]:
        if self._me is None and self._me_of is not None:
            me_of, self._me_of = self._me_of, None
            try:
                self._me = me_of()
            except Exception as exc:  # noqa: BLE001 - without the id nothing is recorded: the group is as before
                logger.warning("%s could not read this group's replica id (%s): quorums issued to a timed-out quorum "
                               "try are not looked for", self._who, exc)
        return self._me

    def look(self, last_id: Optional[int], current: Optional[int]) -> Optional[int]:
        """Read the lighthouse's last quorum once and record it as a dead end if it is unseen (:func:`unseen_quorum`).

        Args:
            last_id: the newest quorum id this rank received; current: the quorum it holds now.

        Returns:
            The id recorded, or ``None``. Never raises: a failed read is counted and logged at DEBUG level.
        """
        me = self._replica_id()
        if me is None:
            return None
        epoch = self._history.epoch
        try:
            status = self._fetch(self._lighthouse, READ_TIMEOUT.total_seconds())
        except (OSError, StatusFormatError, ValueError) as exc:
            self.failed_reads += 1
            logger.debug("%s could not read the lighthouse's status after a quorum try timed out: %s", self._who, exc)
            return None
        qid = unseen_quorum(status.previous_quorum_id, [m.replica_id for m in status.members], me, last_id)
        if qid is None:
            return None
        self.record(epoch, [qid], current)
        if qid not in self.found:
            self.found.append(qid)
        if qid == self._logged:
            return qid
        self._logged = qid
        logger.warning("%s the lighthouse issued quorum %d to a quorum call of this group that timed out (no answer "
                       "reached it): nobody commits in it, counted as a dead end", self._who, qid)
        return qid

    def record(self, epoch: int, ids: Sequence[int], current: Optional[int]) -> None:
        """Record ``ids`` (issued in lighthouse ``epoch``) as dead ends in the history; ``current``: the quorum held."""
        with self._history.lock:
            for qid in ids:
                self._history.never_joined(epoch, qid, current)

    def share(self, store: Any, key: str) -> None:
        """Group rank 0: set ``key`` on the group's store to the ids found since the last call, if any.

        Raises:
            Whatever the store's ``set`` raises.
        """
        found, self.found = self.found, []
        if found:
            store.set(key, encode_ids(found))

    def adopt(self, store: Any, key: str, current: Optional[int]) -> List[int]:
        """A rank other than 0: record the ids its rank 0 shared under ``key`` (if any) as dead ends here too.

        Returns:
            The ids recorded. Never raises: an unreadable or malformed value is logged and records nothing (this
            rank's agreement may then fail where rank 0's passes; it never passes where it should not).
        """
        try:
            ids = decode_ids(bytes(store.get(key))) if store.check([key]) else []
        except Exception as exc:  # noqa: BLE001 - nothing recorded (see Returns)
            logger.error("%s could not read the unseen quorums its rank 0 found (%s)", self._who, exc)
            return []
        if ids:
            self.record(self._history.epoch, ids, current)
        return ids
