"""What every benchmark script prints: JSON lines, rounded figures, goals, and the environment.

Imported by the `bench_*.py` scripts, which run from anywhere as
`python tests/benchmarks/bench_x.py` (this folder is then first on `sys.path`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import transformers

__all__ = ["Goals", "arguments", "emit", "environment", "rounded"]


def arguments(doc: str | None, quick_help: str) -> argparse.ArgumentParser:
    """Every benchmark's command line: its docstring's first paragraph, and ``--quick``."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0] if doc else None)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    return parser


def emit(record: dict[str, Any]) -> None:
    """One JSON line on stdout (progress bars are on stderr, so the two never interleave)."""
    print(json.dumps(record), flush=True)


def rounded(value: float, digits: int = 4) -> float:
    return float(f"{value:.{digits}g}")


@dataclass
class Goals:
    """Targets checked in the summary line."""

    rows: list[dict[str, Any]] = field(default_factory=list)

    def check(self, name: str, value: float, goal: float, *, at_least: bool = True) -> None:
        met = value >= goal if at_least else value <= goal
        self.rows.append(
            {"goal": name, "value": rounded(value), "target": f"{'>=' if at_least else '<='} {goal}", "met": met}
        )


def environment(**versions: str) -> dict[str, Any]:
    """Machine and library versions for the summary line; callers add their own libraries."""
    return {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numpy": np.__version__,
        **versions,
    }
