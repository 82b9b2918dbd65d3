"""The cross-replica message plan: which part of the gradient partition each all-reduce carries.

:func:`plan_messages` cuts the rank's canonical partition (``ZeroAdapter.partition_grads()``
concatenated, :mod:`ftbridge.zero.layout`) once into :class:`Message` s: contiguous ranges
of whole fragments (padding goes with the fragment after it), at least ``min_numel``
elements each but the last, listed from the end of the partition to its start and issued
in exactly that order on every replica. Replicas of the same group size, stage and
settings cut the same plan. :class:`Readiness` releases a message during the boundary
backward once it is complete *and* every message before it was issued.

Why: docs/concepts.md, "Messages fixed by the parameter layout".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Sequence, Tuple

from ftbridge.zero.layout import Fragment, PartitionLayout


@dataclass(frozen=True)
class Message:
    """Elements ``[start, end)`` of the canonical partition and the parameter fragments in them.

    Attributes:
        start, end: element offsets in the canonical partition (``end > start``).
        fragments: the fragments inside the range, by decreasing offset; empty when the layout is
            unknown (the message then only goes after backward). Other elements are padding.
    """

    start: int
    end: int
    fragments: Tuple[Fragment, ...] = ()

    @property
    def numel(self) -> int:
        """Elements in the message."""
        return self.end - self.start

    @property
    def keys(self) -> Tuple[int, ...]:
        """DeepSpeed ids of the parameters in the message (ZeRO-1/2 ``get_param_id``, ZeRO-3 ``ds_id``)."""
        return tuple(dict.fromkeys(f.key for f in self.fragments))


def plan_messages(layout: PartitionLayout, min_numel: int) -> List[Message]:
    """Cut the canonical partition into messages, last parameters first.

    Args:
        layout: the partition's fragments (offsets in elements); fragments without elements are ignored.
        min_numel: smallest message, elements; ``<= 0`` gives one message per fragment.

    Returns:
        Messages tiling ``[0, layout.numel)`` with no gap and no overlap, by decreasing ``start``;
        ``[]`` for an empty partition.
    """
    if layout.numel <= 0:
        return []
    frags = sorted((f for f in layout.fragments if f.numel > 0), key=lambda f: f.offset, reverse=True)
    messages: List[Message] = []
    end, taken = layout.numel, []  # type: int, List[Fragment]
    for f in frags:
        taken.append(f)
        if end - f.offset >= min_numel:
            messages.append(Message(f.offset, end, tuple(taken)))
            end, taken = f.offset, []
    if taken or not messages:
        messages.append(Message(0, end, tuple(taken)))
    elif end > 0:  # leading padding joins the first fragment's message
        last = messages.pop()
        messages.append(Message(0, last.end, last.fragments))
    return messages


class Readiness:
    """Which messages of ``plan`` (in issue order) may be issued now, during one boundary backward."""

    def __init__(self, plan: Sequence[Message]) -> None:
        self.plan = list(plan)
        self._messages_of: Dict[int, List[int]] = {}
        for k, m in enumerate(self.plan):
            for key in m.keys:
                self._messages_of.setdefault(key, []).append(k)
        self.reset()

    def reset(self) -> None:
        """Start a new window: nothing reduced, nothing issued."""
        self._missing = [len(set(m.keys)) for m in self.plan]
        self._seen: set = set()
        self.next = 0
        """Index of the next message to issue."""

    def reduced(self, keys: Iterable[int]) -> List[int]:
        """Record that ``keys``' gradients are final; return the messages that may now be issued, in order.
        Keys outside the plan are ignored.
        """
        for key in keys:
            if key in self._seen or key not in self._messages_of:
                continue
            self._seen.add(key)
            for k in self._messages_of[key]:
                self._missing[k] -= 1
        ready = []
        while self.next < len(self.plan) and self._missing[self.next] == 0:
            ready.append(self.next)
            self.next += 1
        return ready

    def rest(self) -> List[int]:
        """Every message not issued yet (backward ended: what got no gradient is final too)."""
        rest = list(range(self.next, len(self.plan)))
        self.next = len(self.plan)
        return rest
