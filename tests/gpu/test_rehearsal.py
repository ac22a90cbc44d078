"""The GPU check's rehearsal (`tests/gpu/run.sh --rehearse`, ``make gpu-check-rehearsal``): the script a lent GPU
machine runs, run end to end here, so it is known to work before a GPU is lent. The checks that take their
device run on the CPU and pass; the CUDA-only ones report their skip; one verdict line per check."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_check_runs_end_to_end_on_the_cpu() -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(
        [str(ROOT / "tests" / "gpu" / "run.sh"), "--rehearse"], env=env, capture_output=True, text=True, timeout=900
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    verdicts = [line for line in out.splitlines() if line.startswith("[gpu-check] tests/")]
    assert len(verdicts) == out.count("[gpu-check] tests/") and len(verdicts) >= 5, out[-4000:]
    (paths,) = [v for v in verdicts if "test_gpu_paths.py" in v]
    assert "exit 0" in paths and "5 passed" in paths, paths  # Qwen3.5 on Megatron among them
