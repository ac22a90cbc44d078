"""The published figures the twin is checked against: a profile's ``reference`` section (`reference_figures`), and
Relax's, read once from the shipped profile (`RELAX`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import profiles

__all__ = ["RELAX", "reference_figures"]


def reference_figures(profile: Path) -> dict[str, float]:
    """The published figures in a profile's ``reference`` section (each ``{value, source}``), values only.

    They live in the profile, beside the constants, so each keeps its citation; the engine and the trainer never
    read the section, so no constant can be fitted to them by accident. ValueError names the file when the section
    is missing or an entry is not a sourced number."""
    data = profiles.read(profile)
    section = data.get("reference") if isinstance(data, Mapping) else None
    if not isinstance(section, Mapping) or not section:
        raise ValueError(f"{profile}: no 'reference' section of published figures")
    values, _ = profiles.sourced(section, where=str(profile), kind="reference")
    return {name: _number(value, f"{profile}: reference {name}") for name, value in values.items()}


def _number(value: Any, where: str) -> float:
    """An int stays an int (GPUs, prompts: `twin.config` scales by them); YAML 1.1 reads ``1e3`` (no dot) as a
    string, so a string that parses as a number is one."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"{where} must be a number, not {value!r}")
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"{where} must be a number, not {value!r}") from None
    return value


# Relax (arXiv 2604.11554), Qwen3-4B on DAPO-Math-17k, 16xH800, and StaleSync's linearity: the published figures
# the twin is checked on, read from the shipped profile (its ``reference`` section holds their sources).
RELAX: dict[str, float] = reference_figures(profiles.resolve("relax-qwen3-4b-h800"))
