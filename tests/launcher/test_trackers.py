"""`launcher.trackers` and `launcher.run_config`: real wandb, TensorBoard and MLflow runs written under temporary
folders from step records, then read back with each tool's own reader: TensorBoard's `EventAccumulator`, MLflow's
`MlflowClient` on a file store, and for W&B (whose SDK has no offline reader) the ``.wandb`` transaction log
decoded record by record with the SDK's own protobuf schema. With nothing set the runs are files in the run's
folder; each tool's own variables move them (W&B's mode, project, entity, name and folder; MLflow's tracking URI
and experiment; ``TENSORBOARD_DIR``), and a run that cannot start online fails in seconds, naming the variable.
No network: "online" is a closed local port. Also ``config.json``, the ``--report-to`` parsing, the ETA text and
the environment after a run."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from launcher.trackers import REPORTERS, Trackers, config_json, eta, parse_report_to, scalars
from services.settings import SettingsError
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


# Each tool's variables that say where its runs go: unset, the runs are files in the run's folder.
TRACKER_VARIABLES = (
    "WANDB_MODE", "WANDB_API_KEY", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_NAME", "WANDB_DIR", "WANDB_BASE_URL",
    "TENSORBOARD_DIR", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID",
    "MLFLOW_ALLOW_FILE_STORE",
)  # fmt: skip


def _as_if_unset(patch: pytest.MonkeyPatch, home: Path) -> None:
    """A user who set none of `TRACKER_VARIABLES`, with no wandb settings file and no ``wandb login``; wandb's
    process-wide settings (read once, from the environment of the time) dropped, so the next run reads these."""
    import wandb

    for name in TRACKER_VARIABLES:
        patch.delenv(name, raising=False)
    patch.setenv("WANDB_CONFIG_DIR", str(home / "wandb-config"))
    patch.setenv("NETRC", str(home / "netrc"))  # not there: no W&B key on file
    wandb.teardown()


@pytest.fixture
def unset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """`_as_if_unset` for one test, which then sets what it tests; wandb's settings dropped again after it."""
    import wandb

    _as_if_unset(monkeypatch, tmp_path)
    yield monkeypatch
    wandb.teardown()


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A local port bound but not listening: a connection there is refused at once, never waited on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@dataclass(frozen=True, slots=True, kw_only=True)
class Written:
    run_dir: Path
    env_before: dict[str, str]
    env_after: dict[str, str]
    destinations: dict[str, str]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Written]:
    """One run in all three trackers with none of their variables set: files in the run's folder, W&B offline."""
    import wandb

    run_dir = tmp_path_factory.mktemp("run")
    with pytest.MonkeyPatch.context() as patch:
        _as_if_unset(patch, tmp_path_factory.mktemp("home"))
        before = dict(os.environ)
        with Trackers.open(REPORTERS, run_dir=run_dir, run_name="test-run", config=CONFIG) as trackers:
            for record in RECORDS:
                trackers.log(record)
            destinations = trackers.destinations
        after = dict(os.environ)
        wandb.teardown()
    yield Written(run_dir=run_dir, env_before=before, env_after=after, destinations=destinations)


@pytest.mark.integration  # the shared run: wandb-core's process, some seconds
def test_environment_is_as_before_after_close(written: Written) -> None:
    assert written.env_after == written.env_before


@pytest.mark.integration  # the shared run: wandb-core's process, some seconds
def test_with_nothing_set_every_run_is_files_in_the_run_folder(written: Written) -> None:
    run_dir = written.run_dir
    assert written.destinations["wandb"].startswith(f"W&B offline: {run_dir / 'wandb' / 'offline-run-'}")
    assert written.destinations["tensorboard"] == f"TensorBoard: {run_dir / 'tensorboard'}"
    assert written.destinations["mlflow"].startswith(
        f"MLflow: {(run_dir / 'mlruns').resolve().as_uri()}, experiment weir"
    )


@pytest.mark.integration  # the shared run: wandb-core's process, some seconds
def test_tensorboard_event_files_hold_the_scalars_and_hyperparameters(written: Written) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2
    from tensorboard.util import tensor_util

    events = EventAccumulator(str(written.run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
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
    (text,) = events.Tensors("config/text_summary")  # `add_text`: the JSON as a Markdown code block
    shown = tensor_util.make_ndarray(text.tensor_proto).item().decode()
    assert json.loads("\n".join(line.removeprefix("    ") for line in shown.splitlines())) == json.loads(
        config_json(CONFIG)
    )


@pytest.mark.integration  # the shared run: wandb-core's process, some seconds
def test_mlflow_file_store_holds_the_metric_history_params_and_config(
    written: Written, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
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
    config = Path(client.download_artifacts(run.info.run_id, "config.json", str(tmp_path)))
    assert config.read_text() == config_json(CONFIG)


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
    with pytest.raises(ImportError, match=r"--report-to wandb needs the wandb package: pip install .*\[trackers\]'"):
        Trackers.open(["tensorboard", "wandb"], run_dir=tmp_path, run_name="r", config={})
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))  # opened first, then closed


def test_no_trackers_log_nothing(tmp_path: Path) -> None:
    with Trackers.open(parse_report_to("none"), run_dir=tmp_path, run_name="r", config=CONFIG) as trackers:
        trackers.log(RECORDS[0])
    assert not any(tmp_path.iterdir())


def _wandb_start(run: Path) -> tuple[str, str, str]:
    """The project, entity and name of the offline W&B run in folder ``run`` (its run record), once wandb's
    service is done with its file (`wandb.teardown`: its writer may still hold records after ``finish``)."""
    import wandb

    wandb.teardown()
    (log,) = run.glob("run-*.wandb")
    start = next(r.run for r in _wandb_records(log) if r.WhichOneof("record_type") == "run")
    return start.project, start.entity, start.display_name


def _one_run(names: list[str], run_dir: Path) -> dict[str, str]:
    with Trackers.open(names, run_dir=run_dir, run_name="r", config=CONFIG) as trackers:
        trackers.log(RECORDS[0])
        return trackers.destinations


@pytest.mark.integration  # wandb-core's process
def test_wandb_takes_the_users_mode_project_entity_name_and_folder(unset: pytest.MonkeyPatch, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    for name, value in {"WANDB_MODE": "offline", "WANDB_PROJECT": "vision-rl", "WANDB_ENTITY": "lab",
                        "WANDB_NAME": "try-7", "WANDB_DIR": str(elsewhere)}.items():  # fmt: skip
        unset.setenv(name, value)
    destination = _one_run(["wandb"], tmp_path / "run")["wandb"]
    (run,) = (elsewhere / "wandb").glob("offline-run-*")
    assert destination == f"W&B offline: {run}"
    assert _wandb_start(run) == ("vision-rl", "lab", "try-7")
    assert not (tmp_path / "run" / "wandb").exists()


@pytest.mark.integration  # wandb's setup
def test_wandb_disabled_writes_nothing(unset: pytest.MonkeyPatch, tmp_path: Path) -> None:
    unset.setenv("WANDB_MODE", "disabled")
    assert _one_run(["wandb"], tmp_path) == {"wandb": "W&B disabled"}
    assert not (tmp_path / "wandb").exists()


@pytest.mark.integration  # wandb's setup
def test_wandb_online_without_a_key_fails_in_one_line(unset: pytest.MonkeyPatch, tmp_path: Path) -> None:
    unset.setenv("WANDB_MODE", "online")  # honoured: an offline run would need no key
    with pytest.raises(SettingsError, match=r"W&B could not start its online run \(WANDB_MODE=online\): .*API key"):
        Trackers.open(["tensorboard", "wandb"], run_dir=tmp_path, run_name="r", config=CONFIG)
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))  # opened first, then closed


def test_wandb_mode_it_refuses_fails_in_one_line(unset: pytest.MonkeyPatch, tmp_path: Path) -> None:
    unset.setenv("WANDB_MODE", "onlin")
    with pytest.raises(SettingsError, match=r"W&B could not start a run \(WANDB_MODE=onlin\): .*'online', 'offline'"):
        Trackers.open(["wandb"], run_dir=tmp_path, run_name="r", config=CONFIG)


@pytest.mark.integration  # wandb-core's process, its init timeout (3 s here)
def test_wandb_with_a_key_goes_online_and_an_unreachable_server_fails_within_its_timeout(
    unset: pytest.MonkeyPatch, tmp_path: Path, closed_port: int
) -> None:
    unset.setenv("WANDB_API_KEY", "k" * 40)  # a key and no mode: wandb's own default, online
    unset.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{closed_port}")
    unset.setenv("WANDB_INIT_TIMEOUT", "3")  # wandb's own bound on starting a run
    with pytest.raises(SettingsError, match=r"could not start its online run \(WANDB_API_KEY set\)"):
        Trackers.open(["wandb"], run_dir=tmp_path, run_name="r", config=CONFIG)
    assert not list(tmp_path.rglob("offline-run-*"))


@pytest.mark.integration  # MLflow's client on a file store
def test_mlflow_takes_the_users_tracking_uri_and_experiment(unset: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    store = (tmp_path / "team-store").as_uri()  # another file store than the run's folder (no `mlflow server` here)
    unset.setenv("MLFLOW_TRACKING_URI", store)
    unset.setenv("MLFLOW_EXPERIMENT_NAME", "vision-rl")
    destination = _one_run(["mlflow"], tmp_path / "run")["mlflow"]
    assert destination.startswith(f"MLflow: {store}, experiment vision-rl, run ")
    assert not (tmp_path / "run" / "mlruns").exists()
    unset.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # for reading it here
    client = MlflowClient(tracking_uri=store)
    experiment = client.get_experiment_by_name("vision-rl")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["lr"] == "1e-05" and run.data.metrics["loss"] == 1.0
    config = Path(client.download_artifacts(run.info.run_id, "config.json", str(tmp_path)))
    assert json.loads(config.read_text()) == json.loads(config_json(CONFIG))

    unset.delenv("MLFLOW_EXPERIMENT_NAME")  # an experiment by id only: the run goes there
    unset.setenv("MLFLOW_EXPERIMENT_ID", experiment.experiment_id)
    _one_run(["mlflow"], tmp_path / "run")
    assert len(client.search_runs([experiment.experiment_id])) == 2


@pytest.mark.integration  # MLflow's client
def test_mlflow_server_that_does_not_answer_fails_in_one_line(
    unset: pytest.MonkeyPatch, tmp_path: Path, closed_port: int
) -> None:
    unset.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{closed_port}")
    unset.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # MLflow's own retry policy: none here
    with pytest.raises(SettingsError, match=rf"--report-to mlflow: MLFLOW_TRACKING_URI=http://127.0.0.1:{closed_port}"):
        Trackers.open(["mlflow"], run_dir=tmp_path, run_name="r", config=CONFIG)


def test_tensorboard_writes_to_tensorboard_dir(unset: pytest.MonkeyPatch, tmp_path: Path) -> None:
    unset.setenv("TENSORBOARD_DIR", str(tmp_path / "tb" / "try-7"))
    assert _one_run(["tensorboard"], tmp_path / "run") == {"tensorboard": f"TensorBoard: {tmp_path / 'tb' / 'try-7'}"}
    assert list((tmp_path / "tb" / "try-7").glob("events.out.tfevents.*"))
    assert not (tmp_path / "run" / "tensorboard").exists()


def test_config_json_holds_every_resolved_option(tmp_path: Path) -> None:
    from dataclasses import fields

    from launcher.config import DEMO_ARCH_DEFAULTS, TrainConfig
    from launcher.run_config import save_run_config
    from services import __version__

    home = tmp_path / "weir"
    argv = ("train", "--demo", "--steps", "3", "--report-to", "mlflow")
    config = TrainConfig.with_defaults(demo=True, home=home, steps=3, report_to="mlflow", lr=None, argv=argv)
    out = tmp_path / "train" / "async"
    returned = save_run_config(config, out)
    assert [path.name for path in out.iterdir()] == ["config.json"]  # no temporary file left beside it
    saved = json.loads((out / "config.json").read_text())
    assert saved == returned
    assert {field.name for field in fields(TrainConfig)} - {"argv"} <= set(saved)
    assert saved["steps"] == 3 and saved["report_to"] == "mlflow" and saved["demo"] is True
    assert saved["lr"] == DEMO_ARCH_DEFAULTS["qwen3-vl"]["lr"]  # unset: the colour demo's model's default, resolved
    assert saved["home"] == str(home.absolute()) and saved["dataset"] is None and saved["role_url"] == []
    assert saved["model_folder"] == str((home / "model").absolute())  # no --model: HOME/model
    assert saved["seeds"] == {"trainer": 0}
    assert saved["weir_version"] == __version__
    assert saved["argv"] == list(argv)

    resumed = TrainConfig.with_defaults(demo=True, home=home, resume=True)
    save_run_config(resumed, out)  # a resumed run writes it again, whole
    assert json.loads((out / "config.json").read_text())["resume"] is True
    assert [path.name for path in out.iterdir()] == ["config.json"]


def test_config_json_keeps_a_hub_id_as_given_and_an_unbounded_cap_as_text(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from launcher.checks import train_config
    from launcher.cli import build_parser
    from launcher.run_config import run_config

    monkeypatch.chdir(tmp_path)  # no acme/geo3k here: a hub id
    args = build_parser().parse_args(["train", "--dataset", "acme/geo3k", "--correction-cap", "inf"])
    args.argv = []
    config = train_config(args)
    assert config.correction_cap == math.inf and config.loss_config().correction_cap == math.inf  # LossConfig's
    for mode in ("tis", "mis"):  # untruncated IS; no upper mask
        assert dataclasses.replace(config, rollout_correction=mode).loss_config().correction_cap == math.inf

    def strict(name: str) -> None:
        raise AssertionError(f"{name} in config.json: not JSON")

    saved = json.loads(config_json(run_config(config)), parse_constant=strict)
    assert saved["dataset"] == "acme/geo3k" and saved["correction_cap"] == "inf"
    (tmp_path / "rows").mkdir()
    args = build_parser().parse_args(["train", "--dataset", "rows"])  # a folder: its absolute path
    args.argv = []
    assert run_config(train_config(args))["dataset"] == str(tmp_path / "rows")


def test_the_trackers_default_settings_are_not_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from launcher.trackers import tracker_refusal

    for name in ("WANDB_MODE", "WANDB_API_KEY", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    assert tracker_refusal(list(REPORTERS)) is None  # offline W&B, MLflow's file store, TensorBoard's files
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "store").as_uri())
    assert tracker_refusal(["mlflow"]) is None
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "gopher://x")
    assert "gopher://x" in (tracker_refusal(["mlflow"]) or "")
    assert os.environ["MLFLOW_TRACKING_URI"] == "gopher://x"  # the environment as it was


def test_config_json_an_artifact_store_refuses_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    store = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_ID", raising=False)
    MlflowClient(tracking_uri=store).create_experiment("weir", artifact_location="nosuchstore://bucket/weir")
    with pytest.raises(SettingsError, match="--report-to mlflow: config.json as an artifact"):
        Trackers.open(["mlflow"], run_dir=tmp_path / "run", run_name="t", config={"steps": 1})
