"""Argument types of the ``weir`` command line for numbers: each option's range, declared beside it in
`launcher.options` (``type=at_least(1)``), so a value out of it is argparse's one line and exit status 2, before
anything starts. What options may be together is `launcher.checks`.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = ["at_least", "cap_float", "non_negative_float", "port_number", "positive_float"]


def at_least(low: int) -> Callable[[str], int]:
    """A whole number ``low`` or more (``--steps``: ``at_least(1)``; ``--checkpoint-every``: ``at_least(0)``)."""

    def whole(text: str) -> int:
        value = int(text)  # a ValueError: argparse's "invalid int value: 'many'"
        if value < low:
            raise argparse.ArgumentTypeError(f"{value}: give {low} or more")
        return value

    whole.__name__ = "int"  # what argparse names the type in "invalid int value"
    return whole


def _finite(text: str) -> float:
    value = float(text)  # a ValueError: argparse's "invalid float value: 'x'"
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text}: give a finite number")
    return value


def positive_float(text: str) -> float:
    """A finite number above 0 (a learning rate)."""
    value = _finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text}: give a number above 0")
    return value


def non_negative_float(text: str) -> float:
    """A finite number, 0 or more (a KL coefficient, an importance weight's floor)."""
    value = _finite(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text}: give 0 or more")
    return value


def cap_float(text: str) -> float:
    """A number above 0, or ``inf`` for no bound (``--correction-cap``: untruncated IS for tis, no upper mask
    for mis); nan is refused."""
    value = float(text)
    if math.isnan(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text}: give a number above 0 (inf: no bound)")
    return value


positive_float.__name__ = non_negative_float.__name__ = cap_float.__name__ = "float"  # type: ignore[attr-defined]


def port_number(text: str) -> int:
    """A TCP port, 1-65535."""
    value = int(text)
    if not 0 < value <= 65535:
        raise argparse.ArgumentTypeError(f"{value}: a port is 1-65535")
    return value


port_number.__name__ = "int"  # type: ignore[attr-defined]
