"""argparse value types that refuse bad numbers where they are typed, with the flag's fix in the message.

``type=at_least(1)`` for counts, ``type=finite(minimum=0.0)`` for rates and seconds: ``--steps -1``,
``--lr nan`` or ``--grad-accum 0`` end in argparse's usual ``error: argument --lr: ...`` (exit 2)
before anything starts, instead of a traceback or a job that trains nothing.
"""

from __future__ import annotations

import argparse
import math
from typing import Callable


def at_least(minimum: int) -> Callable[[str], int]:
    """An ``int`` type for argparse accepting values ``>= minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below the smallest allowed value, {minimum}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def finite(minimum: float = -math.inf, *, strictly_above: bool = False) -> Callable[[str], float]:
    """A ``float`` type for argparse accepting finite values ``>= minimum`` (``> minimum`` if ``strictly_above``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number")
        if value < minimum or (strictly_above and value == minimum):
            raise argparse.ArgumentTypeError(
                f"{value} must be {'above' if strictly_above else 'at least'} {minimum:g}")
        return value

    parse.__name__ = f"finite number {'>' if strictly_above else '>='} {minimum:g}"
    return parse


def probability(text: str) -> float:
    """A ``float`` type for argparse accepting ``0 <= value < 1`` (a dropout probability)."""
    value = finite(0.0)(text)
    if value >= 1.0:
        raise argparse.ArgumentTypeError(f"{value} must be below 1")
    return value


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` that refuses an empty value written ``--flag=--`` and flag prefixes.

    Plain argparse stores an empty list for ``--flag --`` and accepts any unambiguous prefix (``--spare`` for
    ``--spare-index``), which a later version may turn into another flag. Every ftbridge tool's parser, and
    its subcommands', is built from this class.
    """

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        parsed, extras = super().parse_known_args(args, namespace)
        for action in self._actions:
            value = getattr(parsed, action.dest, None)
            if isinstance(action, argparse._StoreAction) and action.option_strings and action.nargs is None \
                    and isinstance(value, list) and not isinstance(action.default, list):
                self.error(f"argument {'/'.join(action.option_strings)}: expected one value, got none")
        return parsed, extras
