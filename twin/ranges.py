"""The ranges of a profile's decisive estimates (its ``ranges`` section) and the corners they span.

A prediction that one set of constants makes proves little when another set, fitted on the same published figure,
predicts something else (issue 41: three sets that each fit colocate within 1 % put async-1 anywhere from 105 to
138 s/step). So each estimate that decides a prediction carries the range its sources allow:

* ``decode_speed`` — a factor on the engines' decode costs (``moves``: the constants it divides), from published
  decode throughput of models of the size;
* ``mfu`` — the trainer's model FLOPs utilisation (its tokens per second follow), from published MFU figures.

`corners` is the profile's own point and every combination of the ranges' ends; `weir twin calibrate` refits the
one knob on colocate at each (`twin.held_out`) and `weir twin plan` ranks by the worst of them.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import profiles
from engines.sim_profile import SimProfile

__all__ = ["Corner", "Range", "corners", "read_ranges"]


@dataclass(frozen=True, slots=True)
class Range:
    """One estimate's range: its ends, the constants a factor moves (empty: ``mfu``, a value), its source."""

    name: str
    low: float
    high: float
    moves: tuple[str, ...]
    source: str


@dataclass(frozen=True, slots=True)
class Corner:
    """A point of the ranges: a decode-speed factor and an MFU (None: the profile's own)."""

    decode_speed: float = 1.0
    mfu: float | None = None

    @property
    def label(self) -> str:
        mfu = "profile" if self.mfu is None else f"{self.mfu:g}"
        return f"decode x{self.decode_speed:g}, MFU {mfu}"

    def overrides(self, engine: SimProfile, moves: tuple[str, ...]) -> tuple[dict[str, float], dict[str, float]]:
        """The engine constants (each of ``moves`` divided by the speed factor) and trainer constants it sets."""
        engine_changes = {name: getattr(engine, name) / self.decode_speed for name in moves}
        return engine_changes, ({} if self.mfu is None else {"mfu": self.mfu})


_KNOWN = {"decode_speed", "mfu"}


def read_ranges(profile: Path) -> dict[str, Range]:
    """The profile's ``ranges`` section (empty when it has none). ValueError names the file and the entry when an
    entry is not ``{low, high, source}`` with ``0 < low <= high``, or names an estimate the twin does not range."""
    data = profiles.read(profile)
    section = data.get("ranges") if isinstance(data, Mapping) else None
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        raise ValueError(f"{profile}: 'ranges' must map estimates to {{low, high, source}}")
    out: dict[str, Range] = {}
    for name, entry in section.items():
        where = f"{profile}: ranges.{name}"
        if name not in _KNOWN:
            raise ValueError(f"{where}: the twin ranges {', '.join(sorted(_KNOWN))}, not {name!r}")
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where} must be {{low, high, source}}")
        low, high, source = _number(entry.get("low"), where), _number(entry.get("high"), where), entry.get("source")
        if not 0 < low <= high:
            raise ValueError(f"{where}: needs 0 < low <= high, not {low} / {high}")
        if not isinstance(source, str) or not source.strip():
            raise ValueError(f"{where} has no source")
        moves = entry.get("moves", [])
        if not isinstance(moves, list) or not all(isinstance(m, str) for m in moves):
            raise ValueError(f"{where}: moves is a list of constants' names")
        unknown = [m for m in moves if m not in SimProfile.__dataclass_fields__]
        if unknown:
            raise ValueError(f"{where}: moves names no engine constant {', '.join(unknown)}")
        out[name] = Range(name, low, high, tuple(moves), source)
    return out


def _number(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}: low and high must be numbers, not {value!r}")
    return float(value)


def corners(ranges: Mapping[str, Range]) -> list[Corner]:
    """The profile's own point first, then every combination of the ranges' ends (four with both ranges)."""
    speed = ranges.get("decode_speed")
    mfu = ranges.get("mfu")
    speeds = (speed.low, speed.high) if speed else (1.0,)
    mfus: tuple[float | None, ...] = (mfu.low, mfu.high) if mfu else (None,)
    out = [Corner()]
    out += [Corner(s, m) for s, m in itertools.product(speeds, mfus) if (s, m) != (1.0, None)]
    return out
