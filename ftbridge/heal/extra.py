"""State a heal and a checkpoint carry beyond DeepSpeed's, registered by key: :class:`ExtraState`.

Users register it with ``engine.ftbridge.register_state`` (the data position, a Trainer's state, the
random number generators). An entry registered ``at_step_start`` is read on the training thread at the
start of every step, before the forward, and a heal carries that value; a group that heals before its
first forward (restarted, or a warm spare) applies it then, so that what its forward consumes (random
numbers) is what the donor's consumed. A group that heals mid-step takes them again at the end of its heal
step, as the donor held them at its commit vote (:meth:`ExtraState.step_end_body`, relayed by
:mod:`ftbridge.manager.step_end`). Why: ``docs/heal.md``, "What a heal carries".
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Set, Tuple

from ftbridge.heal.wire import decode_state, encode_state
from ftbridge.zero.state import from_wire, to_wire

StateFn = Callable[[], Dict[str, Any]]
LoadFn = Callable[[Dict[str, Any]], None]


class ExtraState:
    """The registered entries of one rank, their values at the step's start, and which were applied early."""

    def __init__(self) -> None:
        self._entries: Dict[str, Tuple[StateFn, LoadFn]] = {}
        self._at_step_start: Set[str] = set()
        self._snapshots: Dict[str, Any] = {}
        self._applied: Set[str] = set()

    def register(self, key: str, state_dict: StateFn, load_state_dict: LoadFn, *, at_step_start: bool = False) -> None:
        """Add an entry (see ``FTBridgeEngine.register_state``).

        Raises:
            ValueError: ``key`` is already registered.
        """
        if key in self._entries:
            raise ValueError(f"heal state key {key!r} is already registered; pick another name")
        self._entries[key] = (state_dict, load_state_dict)
        if at_step_start:
            self._at_step_start.add(key)

    def begin_step(self) -> None:
        """Training thread, before the step's quorum starts: read the ``at_step_start`` entries."""
        self._applied.clear()
        self._snapshots = {k: to_wire(self._entries[k][0]()) for k in sorted(self._at_step_start)}

    @property
    def forward_consumed(self) -> bool:
        """Whether any entry is registered ``at_step_start`` (state the forward consumes)."""
        return bool(self._at_step_start)

    def step_end_body(self) -> bytes:
        """The ``at_step_start`` entries as they stand now (a donor, right before its commit vote), encoded with
        :func:`ftbridge.heal.wire.encode_state`."""
        return encode_state({k: to_wire(self._entries[k][0]()) for k in sorted(self._at_step_start)})

    def load_step_end(self, body: bytes) -> None:
        """Apply a donor's :meth:`step_end_body` (a joiner, after its heal step committed): the ``at_step_start``
        entries it holds; entries it lacks keep this rank's value.

        Raises:
            ValueError: ``body`` is not a valid encoding, or an entry's keys or tensor shapes differ.
        """
        wire = decode_state(body)
        for k in sorted(self._at_step_start):
            if k in wire:
                fn, load = self._entries[k]
                load(from_wire(fn(), wire[k]))

    def end_step(self) -> None:
        """The step ended (committed or not): between steps every entry is read when asked for."""
        self._snapshots = {}

    def wire(self) -> Dict[str, Any]:
        """Every entry in wire form (:func:`ftbridge.zero.state.to_wire`): ``at_step_start`` ones as read at the
        start of the current step, the others now."""
        return {k: self._snapshots[k] if k in self._snapshots else to_wire(fn())
                for k, (fn, _) in self._entries.items()}

    def load(self, wire: Dict[str, Any], *, before_forward: bool = False) -> None:
        """Apply a peer's :meth:`wire`: with ``before_forward`` only the ``at_step_start`` entries, which the
        step's later load then leaves as they are. Entries the peer lacks keep this rank's value.

        Raises:
            ValueError: an entry's keys or tensor shapes differ from this rank's.
        """
        for k, (fn, load) in self._entries.items():
            if k not in wire or k in self._applied or (before_forward and k not in self._at_step_start):
                continue
            load(from_wire(fn(), wire[k]))
            if before_forward:
                self._applied.add(k)
