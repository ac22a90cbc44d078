"""The SGLang benchmark's harness (`tests/benchmarks/bench_sglang.py`) on the stand-in: both servers answer
every request of every concurrency, with every token, and the comparison is written. No time is asserted."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from encoders.embedded_model import init_model

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_sglang.py"


def test_the_harness_runs_both_servers_on_the_standin(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("bench_sglang", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    model = init_model(tmp_path / "model")
    results = bench.run(backend="standin", model=model, concurrency=[1, 8], requests=8, max_new_tokens=4)
    assert [(r["server"], r["concurrency"]) for r in results["runs"]] == [
        ("peer", 1),
        ("peer", 8),
        ("weir", 1),
        ("weir", 8),
    ]
    assert all(r["tokens"] == 8 * 4 for r in results["runs"])
    assert set(results["weir_share"]) == {"1", "8"}
