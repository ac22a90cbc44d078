"""The twin tests' profiles: Relax's shipped one, and a copy of it with short responses (seconds of simulated
time per step) for cost-model runs that take a fraction of a second."""

from __future__ import annotations

from pathlib import Path

import yaml

RELAX = Path(__file__).resolve().parents[2] / "profiles" / "relax-qwen3-4b-h800.yaml"


def short_profile(path: Path, **constants: float) -> Path:
    """Relax's profile with short responses and no calibration; ``constants`` changed too (each by name)."""
    data = yaml.safe_load(RELAX.read_text())
    data.pop("calibration", None)  # its fits (and the corners' lengths `plan` would use) are for Relax's lengths
    values = {"length_median": 60, "max_response_tokens": 256, **constants}
    for name, value in values.items():
        data["constants"][name]["value"] = value
    path.write_text(yaml.safe_dump(data))
    return path
