"""A short `weir train --demo` run with periodic evaluation and every tracker: the step records carry the
evaluation and the mismatch monitor, eval.jsonl, config.json and the trackers' own files are written, and the
progress lines count the steps with an ETA."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.ports import free_stack_base


@pytest.mark.integration
def test_a_short_run_writes_evaluations_mismatch_and_tracker_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from launcher.cli import main

    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DIR", "TENSORBOARD_DIR", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)  # each tool's own variables unset: its files in the run's folder
    home = tmp_path / "weir"
    argv = ["train", "--demo", "--home", str(home), "--steps", "2", "--warmup-steps", "1", "--eval-every", "1",
            "--eval-k", "2", "--report-to", "tensorboard,mlflow,wandb"]  # fmt: skip
    argv += ["--base-port", str(free_stack_base())]
    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "step 1/2, ETA" in out and "step 2/2" in out and "eval pass@1" in out
    run = home / "train" / "async"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evaluations = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evaluations] == [1, 2] and [r["eval"] for r in records] == evaluations
    first = evaluations[0]
    assert first["rows"] == 16 and 0.0 <= first["pass@1"] <= first["pass@2"] <= 1.0
    assert set(first["by_modality"]) == {"image"} and set(first["by_source"]) == {"default"}
    assert all(r["mismatch/image/tokens"] > 0 and r["mismatch/all/kl"] >= 0.0 for r in records)
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert list((run / "mlruns").rglob("metrics/loss"))  # the file store: one file per metric
    assert list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    config = json.loads((run / "config.json").read_text())  # every resolved option, written before the first step
    assert config["steps"] == 2 and config["report_to"] == "tensorboard,mlflow,wandb" and config["argv"] == argv
    assert (run / "mismatch.png").stat().st_size > 0
