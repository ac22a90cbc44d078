"""The soak script's judgement (`tests/benchmarks/soak.py`): least-squares growth per 10 minutes after warm-up,
flat within the tolerance (and one unit for counts); RSS and descriptors are reported, not judged."""

from __future__ import annotations

import os
from pathlib import Path

from tests.benchmarks.soak import _process_figures, _slope_per_10min, plot, report


def samples(anon: list[float], files: list[float]) -> list[dict]:
    return [
        {
            "t": 60.0 * i,
            "processes": {"data": {"anon_mib": a, "files": f, "threads": 8.0, "rss_mib": a + 100 * i, "fds": 40.0 + i}},
            "sizes": {"cache_mib": 1.0 * i, "embeddings_mib": 0.5 * i, "data_mib": 2.0},
        }
        for i, (a, f) in enumerate(zip(anon, files, strict=True))
    ]


def test_a_slope_per_ten_minutes() -> None:
    assert _slope_per_10min([(0.0, 1.0), (60.0, 2.0), (120.0, 3.0)]) == 10.0
    assert _slope_per_10min([(0.0, 5.0)]) == 0.0


def test_flat_growing_and_recorded_series(tmp_path: Path) -> None:
    flat = samples([500.0, 900.0, 501.0, 500.0, 502.0, 501.0], [10, 30, 11, 10, 10, 11])  # the spike is warm-up
    lines = {(r["process"], r["series"]): r for r in report(flat, warmup_s=120.0, tolerance=0.05)}
    assert (
        lines[("data", "anon_mib")]["flat"] and lines[("data", "files")]["flat"] and lines[("data", "threads")]["flat"]
    )
    assert "flat" not in lines[("data", "rss_mib")] and "flat" not in lines[("data", "fds")]  # recorded only
    assert lines[("disk", "cache_mib")]["growth_per_10min"] == 10.0
    growing = samples([500.0, 510.0, 540.0, 570.0, 600.0, 630.0], [10, 12, 14, 16, 18, 20])
    lines = {(r["process"], r["series"]): r for r in report(growing, warmup_s=120.0, tolerance=0.05)}
    assert not lines[("data", "anon_mib")]["flat"] and not lines[("data", "files")]["flat"]
    assert plot(flat, 120.0, tmp_path / "soak.png").stat().st_size > 1000


def test_this_process_is_measured() -> None:
    figures = _process_figures(os.getpid())
    assert figures is not None and 0 < figures["anon_mib"] <= figures["rss_mib"] and figures["threads"] >= 1
