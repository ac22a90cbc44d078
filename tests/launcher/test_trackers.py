"""`launcher.trackers`: real wandb (offline), TensorBoard and MLflow runs written under a temporary folder from
step records, then read back with each tool's own reader: TensorBoard's `EventAccumulator`, MLflow's
`MlflowClient` on the file store, and for W&B (whose SDK has no offline reader) the ``.wandb`` transaction log
decoded record by record with the SDK's own protobuf schema. Also the ``--report-to`` parsing, the ETA text and
the environment after a run."""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from launcher.trackers import REPORTERS, Trackers, eta, parse_report_to, scalars
from trainer.step_record import StepRecord

CONFIG = {"mode": "async", "lr": 1e-5, "steps": 3, "home": Path("/tmp/weir-home"), "max_staleness": None}


def _record(step: int) -> dict[str, Any]:
    """A `StepRecord` line of metrics.jsonl plus what trainers add: a nested dict, a flag and a note."""
    record = StepRecord(
        step=step,
        time_s=2.0 * step,
        mode="async",  # a string: not logged
        mean_reward=0.25 * step,
        samples=16,
        tokens=4096 * step,
        ranks=1,
        samples_per_s=8.0,
        tokens_per_s=2048.0,
        loss=1.0 / step,
        grad_norm=math.nan if step == 2 else 0.5,  # not finite: not logged at step 2
        policy_version=step,
        staleness=1,
        straddled_samples=0,
        straddled_share=0.0,
        kept_tokens_total=None,  # unreadable: not logged
        queue_samples=4,
        dropped_stale=0,
        regenerated=0,
        first_forward_s=0.5,
        first_forward_at=1.7e9,
        trainer_idle_share=0.1,
        engine_idle_share=None,
    ).as_dict()
    return {**record, "mismatch": {"image": {"kl": 0.01 * step}}, "clipped": step == 1, "note": "warm"}


RECORDS = [_record(step) for step in (1, 2, 3)]


@dataclass(frozen=True, slots=True, kw_only=True)
class Written:
    run_dir: Path
    env_before: dict[str, str]
    env_after: dict[str, str]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Written]:
    """One run in all three trackers; WANDB_MODE=online beforehand shows the run is offline all the same."""
    run_dir = tmp_path_factory.mktemp("run")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "online")
        patch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
        before = dict(os.environ)
        with Trackers.open(REPORTERS, run_dir=run_dir, run_name="test-run", config=CONFIG) as trackers:
            for record in RECORDS:
                trackers.log(record)
        after = dict(os.environ)
    yield Written(run_dir=run_dir, env_before=before, env_after=after)


@pytest.mark.integration  # the shared run: wandb-core's process, some seconds
def test_environment_is_as_before_after_close(written: Written) -> None:
    assert written.env_after == written.env_before


@pytest.mark.integration  # the shared run: wandb-core's process, some seconds
def test_tensorboard_event_files_hold_the_scalars_and_hyperparameters(written: Written) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    events = EventAccumulator(str(written.run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "mean_reward", "mismatch/image/kl", "grad_norm", "samples"} <= tags
    assert not tags & {"step", "mode", "kept_tokens_total", "engine_idle_share", "clipped", "note"}
    loss = events.Scalars("loss")
    assert [event.step for event in loss] == [1, 2, 3]
    assert [event.value for event in loss] == pytest.approx([1.0, 0.5, 1 / 3])
    kl = events.Scalars("mismatch/image/kl")
    assert [event.step for event in kl] == [1, 2, 3]
    assert [event.value for event in kl] == pytest.approx([0.01, 0.02, 0.03])  # stored as float32
    assert [event.step for event in events.Scalars("grad_norm")] == [1, 3]  # NaN at step 2 left out

    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    start = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    assert start.hparams["mode"].string_value == "async"
    assert start.hparams["lr"].number_value == pytest.approx(1e-5)
    assert start.hparams["home"].string_value == "/tmp/weir-home"
    assert start.hparams["max_staleness"].string_value == "None"


@pytest.mark.integration  # the shared run: wandb-core's process, some seconds
def test_mlflow_file_store_holds_the_metric_history_and_params(
    written: Written, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's opt-in for reading a file store too
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    client = MlflowClient(tracking_uri=(written.run_dir / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("weir")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "test-run"
    assert run.info.status == "FINISHED"
    assert run.data.params == {
        "mode": "async",
        "lr": "1e-05",
        "steps": "3",
        "home": "/tmp/weir-home",
        "max_staleness": "None",
    }
    loss = client.get_metric_history(run.info.run_id, "loss")
    assert [(metric.step, metric.value) for metric in loss] == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))]
    kl = client.get_metric_history(run.info.run_id, "mismatch/image/kl")
    assert [(metric.step, metric.value) for metric in kl] == [(1, 0.01), (2, 0.02), (3, 0.03)]
    assert [metric.step for metric in client.get_metric_history(run.info.run_id, "grad_norm")] == [1, 3]
    assert not set(run.data.metrics) & {"step", "mode", "kept_tokens_total", "engine_idle_share", "clipped", "note"}


def _wandb_records(path: Path) -> Iterator[Any]:
    """The records of a ``.wandb`` file: a 7-byte header (":W&B", 0xBEE1, version 0), then LevelDB's log format
    (32 KiB blocks; chunks of a 4-byte CRC, 2-byte length, 1-byte type: full, first, middle, last) around each
    serialized `wandb_internal_pb2.Record`. wandb 0.31's SDK has no Python reader of its own for these."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0)
    block, offset, pending = 32 * 1024, 7, b""
    while offset + 7 <= len(data):
        if block - offset % block < 7:  # too little room for a chunk header: the block's padding
            offset += block - offset % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[offset : offset + 7])
        if kind == 0:  # zero padding at the end of the file
            break
        payload = data[offset + 7 : offset + 7 + length]
        offset += 7 + length
        pending = payload if kind in (1, 2) else pending + payload
        if kind in (1, 4):  # full, or the last chunk of a record
            yield wandb_internal_pb2.Record.FromString(pending)


@pytest.mark.integration  # the shared run: wandb-core's process, some seconds
def test_wandb_offline_run_holds_the_history_and_config(written: Written) -> None:
    (run,) = (written.run_dir / "wandb").glob("offline-run-*")
    (log,) = run.glob("run-*.wandb")
    history: dict[int, dict[str, Any]] = {}
    config: dict[str, Any] = {}
    for record in _wandb_records(log):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[record.history.step.num] = items
        elif kind == "run":  # the run's start, its config included
            assert record.run.display_name == "test-run"
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
    assert sorted(history) == [1, 2, 3]
    assert [history[step]["loss"] for step in (1, 2, 3)] == pytest.approx([1.0, 0.5, 1 / 3])
    assert [history[step]["mismatch/image/kl"] for step in (1, 2, 3)] == pytest.approx([0.01, 0.02, 0.03])
    assert "grad_norm" not in history[2]
    assert not {"step", "mode", "kept_tokens_total", "engine_idle_share", "clipped", "note"} & set(history[1])
    assert {key: config[key] for key in CONFIG} == {
        "mode": "async",
        "lr": 1e-5,
        "steps": 3,
        "home": "/tmp/weir-home",
        "max_staleness": "None",
    }


def test_scalars_flatten_and_keep_only_finite_numbers() -> None:
    values = scalars({"step": 7, "loss": 0.5, "ok": True, "note": "x", "none": None, "inf": math.inf, "a": {"b": 2}})
    assert values == {"loss": 0.5, "a/b": 2.0}


def test_parse_report_to() -> None:
    assert parse_report_to("wandb,tensorboard") == ["wandb", "tensorboard"]
    assert parse_report_to(" MLflow , wandb,mlflow ") == ["mlflow", "wandb"]
    assert parse_report_to("none") == []
    assert parse_report_to("") == []
    with pytest.raises(ValueError, match=r"'comet'.*wandb, tensorboard, mlflow"):
        parse_report_to("wandb,comet")


def test_eta_text() -> None:
    assert eta(3, 10, 27.86) == "step 3/10, ETA 1m 05s"
    assert eta(0, 10, 0.0) == "step 0/10, ETA -"
    assert eta(5, 0, 12.0) == "step 5"
    assert eta(10, 10, 50.0) == "step 10/10, ETA 0s"
    assert eta(2, 1000, 20.0) == "step 2/1000, ETA 2h 46m"
    assert eta(12, 20, 8.0, resumed_at=10) == "step 12/20, ETA 32s"  # 2 steps in 8 s since the resume


def test_missing_package_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # how Python reports a package that is not installed
    with pytest.raises(ImportError, match=r"--report-to wandb needs the wandb package: pip install 'weir\[trackers\]'"):
        Trackers.open(["tensorboard", "wandb"], run_dir=tmp_path, run_name="r", config={})
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))  # opened first, then closed


def test_no_trackers_log_nothing(tmp_path: Path) -> None:
    with Trackers.open(parse_report_to("none"), run_dir=tmp_path, run_name="r", config=CONFIG) as trackers:
        trackers.log(RECORDS[0])
    assert not any(tmp_path.iterdir())
