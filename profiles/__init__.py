"""The cost models the sim engine and the sim trainer read (``*.yaml`` here), shipped as package data so an
installed ``weir`` finds them as a checkout does. Each constant cites its source inside the file; what the
constants mean is `engines.sim_profile` and `trainer.sim_trainer`. This module finds the files and reads what
every section of one has in common: the file itself (`read`) and its ``{value, source}`` entries (`sourced`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["FOLDER", "names", "read", "resolve", "sourced"]

FOLDER = Path(__file__).resolve().parent


def names() -> list[str]:
    """The shipped profiles, by name (the file name without ``.yaml``)."""
    return sorted(path.stem for path in FOLDER.glob("*.yaml"))


def resolve(value: str | Path) -> Path:
    """A profile file: ``value`` when that file exists, else the shipped profile it names — as a bare name
    (``relax-qwen3-4b-h800``), a file name, or the checkout's path (``profiles/relax-qwen3-4b-h800.yaml``),
    so the defaults work from any folder and from an installed package. ValueError names what is shipped."""
    path = Path(value)
    if path.is_file():
        return path
    if not path.is_absolute():
        name = path.name if path.suffix in (".yaml", ".yml") else f"{path.name}.yaml"
        shipped = FOLDER / name
        if path.parent in (Path("."), Path("profiles")) and shipped.is_file():
            return shipped
    raise ValueError(f"{value}: no such profile file (shipped profiles: {', '.join(names())})")


def read(path: str | Path) -> Any:
    """A profile file's contents: JSON when it is named ``.json``, else YAML (``.yaml`` / ``.yml``)."""
    text = Path(path).read_text()
    if Path(path).suffix == ".json":
        return json.loads(text)
    import yaml  # only when a YAML file is read: finding a profile (`resolve`, for `weir --help`) needs none

    return yaml.safe_load(text)


def sourced(entries: Mapping[str, Any], *, where: str, kind: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The values and the sources of a section's entries, by name, in the file's order. Each entry is a figure and
    where it comes from, ``{value: ..., source: ...}``: ValueError names ``where`` (the file), the ``kind`` of
    entry (``constant``, ``trainer constant``, ``reference``) and the entry when it has no value or no source."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name, entry in entries.items():
        if not isinstance(entry, Mapping) or "value" not in entry:
            raise ValueError(f"{where}: {kind} {name} must be {{value: ..., source: ...}}")
        source = entry.get("source")
        if not isinstance(source, str) or not source.strip():
            raise ValueError(f"{where}: {kind} {name} has no source")
        values[name] = entry["value"]
        sources[name] = source
    return values, sources
