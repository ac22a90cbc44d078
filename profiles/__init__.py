"""The cost models the sim engine and the sim trainer read (``*.yaml`` here), shipped as package data so an
installed ``weir`` finds them as a checkout does. Each constant cites its source inside the file; what the
constants mean is `engines.sim_profile` and `trainer.sim_trainer`. This module only finds the files.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["FOLDER", "names", "resolve"]

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
