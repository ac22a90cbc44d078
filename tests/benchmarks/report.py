"""What every benchmark script prints: JSON lines, rounded figures, goals, and the environment.

Imported by the `bench_*.py` scripts, which run from anywhere as
`python tests/benchmarks/bench_x.py` (this folder is then first on `sys.path`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import transformers

__all__ = ["Goals", "arguments", "emit", "environment", "floor_fields", "one_core", "rounded"]


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

    def check(self, name: str, value: float, goal: float, *, at_least: bool = True, **extra: Any) -> None:
        """Record one goal; ``extra`` (e.g. the floor's rate and each side's share of it) goes into its row."""
        met = value >= goal if at_least else value <= goal
        self.rows.append(
            {
                "goal": name,
                "value": rounded(value),
                "target": f"{'>=' if at_least else '<='} {goal}",
                "met": met,
                "verdict": "met" if met else "missed",
                **extra,
            }
        )

    def print_table(self) -> None:
        """The goals as a table on stderr (stdout stays JSON lines), with any floor columns their rows carry."""
        extra = [k for k in dict.fromkeys(k for row in self.rows for k in row) if k not in _ROW_KEYS]
        lines = [["goal", "value", "target", "verdict", *extra]]
        lines += [[str(row.get(k, "")) for k in ("goal", "value", "target", "verdict", *extra)] for row in self.rows]
        widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
        for line in lines:
            print("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)), file=sys.stderr)


_ROW_KEYS = ("goal", "value", "target", "met", "verdict")


def floor_fields(per: dict[str, tuple[float, float]], name: str, peer: str | None = None) -> dict[str, float]:
    """The floor's rate beside a ratio, from ``per`` = {contender: (items, seconds)} with a ``floor`` entry:
    the floor's items/s and ``name``'s (and ``peer``'s) throughput as a share of it."""
    work, floor_s = per["floor"]
    fields = {"floor_items_per_s": rounded(work / floor_s), "share_of_floor": rounded(floor_s / per[name][1])}
    if peer is not None:
        fields["peer_share_of_floor"] = rounded(floor_s / per[peer][1])
    return fields


@contextmanager
def one_core() -> Iterator[int]:
    """Run the block on one CPU with one torch thread (goals stated per core), then restore both. Pinning
    also holds FFmpeg's and decord's own decoder threads, which set_num_threads does not reach."""
    threads = torch.get_num_threads()
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    torch.set_num_threads(1)
    if cpus:
        os.sched_setaffinity(0, {min(cpus)})
    try:
        yield min(cpus) if cpus else -1
    finally:
        torch.set_num_threads(threads)
        if cpus:
            os.sched_setaffinity(0, cpus)


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
