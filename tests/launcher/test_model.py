"""The model `weir train` trains (`launcher.model`): ``--model`` as a folder or a hub id, and a stack it attaches
to that serves another model refused — against real roles on loopback ports at a stack's ports."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn

from launcher.cli import build_parser, main
from launcher.config import TrainConfig
from launcher.model import attach_refusal, run_model
from launcher.stack import stack_model, stack_ports
from services.settings import SettingsError
from tests.ports import free_stack_base

from ..services.conftest import RunningServer
from ..services.test_model_ref import MAIN, REPO, fake_hub_snapshot


class _ServerAt(RunningServer):
    """A role's app on a given loopback port (a stack's, so `LocalStack.attach` finds it)."""

    def __init__(self, app: object, port: int) -> None:
        self.app, self.port, self.url = app, port, f"http://127.0.0.1:{port}"
        self._held = None  # the stack's port is given, not held by the test
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    """Every role of a stack at ``base_port``'s ports, serving the tiny model (no token): (base port, model)."""
    from encoders.embedded_model import init_model
    from services.data.app import create_app as data_app
    from services.data.settings import DataSettings
    from services.encoder.app import create_app as encoder_app
    from services.encoder.settings import EncoderSettings
    from services.engine.app import create_app as engine_app
    from services.engine.settings import EngineSettings
    from services.preprocess import PreprocessSettings
    from services.preprocess import create_app as preprocess_app
    from services.rollout.app import create_app as rollout_app
    from services.rollout.settings import RolloutSettings

    root = tmp_path_factory.mktemp("served")
    model = init_model(root / "model")
    (root / "media").mkdir()
    base = free_stack_base()
    port = {role: p for _, role, p in stack_ports(base)}
    url = {role: f"http://127.0.0.1:{p}" for role, p in port.items()}
    caches = {"cache_dir": root / "cache", "embedding_cache_dir": root / "emb"}
    servers = [
        _ServerAt(
            preprocess_app(PreprocessSettings(cache_dir=root / "cache", media_roots=[root / "media"])),
            port["preprocess"],
        ),
        _ServerAt(encoder_app(EncoderSettings(model=model, **caches)), port["encoder"]),
        _ServerAt(engine_app(EngineSettings(model=model, **caches)), port["engine"]),
        _ServerAt(data_app(DataSettings(data_dir=root / "data")), port["data"]),
        _ServerAt(
            rollout_app(
                RolloutSettings(
                    model=model,
                    engine_urls=[url["engine"]],
                    preprocess_url=url["preprocess"],
                    encoder_url=url["encoder"],
                    data_url=url["data"],
                )
            ),
            port["rollout"],
        ),
    ]
    for server in servers:
        server.__enter__()
    yield base, model
    for server in servers:
        server.__exit__()


def _dataset(tmp_path: Path) -> Path:
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text(
        '{"messages": [{"role": "user", "content": "hi"}], "reward": {"type": "exact_match", "answer": "hi"}}\n'
    )
    return dataset


def test_attach_refuses_a_stack_that_serves_another_model(
    served: tuple[int, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base, model = served
    other = shutil.copytree(model, tmp_path / "other")
    attach = ["train", "--dataset", str(_dataset(tmp_path)), "--attach", "--base-port", str(base)]
    assert main([*attach, "--home", str(tmp_path / "w"), "--model", str(other)]) == 2
    refusal = capsys.readouterr().err.strip().splitlines()[-1]  # after the stack's own log lines
    assert f"serves {model}" in refusal and f"would train {other}" in refusal and "\n" not in refusal
    # Without --model the run trains HOME/model, which is not what this stack serves either: refused too.
    assert main([*attach, "--home", str(tmp_path / "w")]) == 2
    assert f"would train {(tmp_path / 'w' / 'model').absolute()}" in capsys.readouterr().err


def test_attach_takes_a_stack_that_serves_the_run_s_model(served: tuple[int, Path], tmp_path: Path) -> None:
    from launcher.stack import LocalStack

    base, model = served
    stack = LocalStack(home=tmp_path / "w", base_port=base)
    urls = stack.attach()
    config = TrainConfig(home=tmp_path / "w", model=str(model), attach=True)
    assert run_model(config) == model and attach_refusal(urls, stack.token, run_model(config)) is None


def test_train_takes_a_model_folder_or_a_hub_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = build_parser()
    assert parser.parse_args(["train", "--demo", "--model", f"{REPO}@v1"]).model == f"{REPO}@v1"
    assert parser.parse_args(["train", "--demo"]).model is None
    assert parser.parse_args(["up", "--model", REPO]).model == REPO
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    home = str(tmp_path / "w")
    # not in the cache: one line naming the id and how to fetch it, before any stack starts
    assert main(["train", "--dataset", str(_dataset(tmp_path)), "--home", home, "--model", "weir-test/absent"]) == 2
    out = capsys.readouterr().err.strip()  # a refusal is said on stderr
    assert "weir-test/absent" in out and "hf download weir-test/absent" in out and "\n" not in out
    assert not (tmp_path / "w" / "model").exists()  # no tiny model made in its place


def test_a_stack_serves_a_hub_id_s_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from encoders.embedded_model import init_model

    cache = tmp_path / "hub"
    snapshot = fake_hub_snapshot(cache, REPO, init_model(tmp_path / "tiny"), MAIN, "main")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert stack_model(tmp_path / "w", REPO) == snapshot.absolute()
    assert run_model(TrainConfig(home=tmp_path / "w", model=REPO)) == snapshot.absolute()
    with pytest.raises(SettingsError, match="^--model weir-test/absent .*hf download weir-test/absent"):
        stack_model(tmp_path / "w", "weir-test/absent")


@pytest.mark.parametrize(
    ("arch", "options", "asked"),
    [
        ("qwen3", {}, False),  # a dense model has no experts to report
        ("qwen3", {"r3": True}, True),  # (refused elsewhere: R3 needs a MoE model)
        ("qwen3-moe", {}, True),  # the routing monitor's, R3 off
        ("qwen3-moe", {"backend": "sglang", "sglang_args": '{"device": "cpu"}'}, False),  # SGLang cannot on the CPU
        ("qwen3-moe", {"backend": "sglang", "sglang_args": "{}"}, True),  # on a GPU it can
        ("qwen3-moe", {"backend": "sglang", "sglang_args": '{"device": "cpu"}', "r3": True}, True),  # refused at start
    ],
)
def test_which_runs_ask_the_engines_for_their_routes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str, options: dict[str, object], asked: bool
) -> None:
    import engines.sglang_args
    from launcher.model import engines_report_routes

    for variable in ("WEIR_DEVICE", "WEIR_BACKEND", "WEIR_SGLANG_ARGS"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(engines.sglang_args, "routes_on_cpu", lambda: False)  # SGLang as installed, without CUDA

    config = TrainConfig(home=tmp_path / "w", arch=arch, **options)  # type: ignore[arg-type]
    assert engines_report_routes(config) is asked


def test_an_sglang_engine_on_the_cpu_by_weir_device_is_asked_for_no_routes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import engines.sglang_args
    from launcher.model import engines_report_routes

    config = TrainConfig(home=tmp_path / "w", arch="qwen3-moe", backend="sglang", sglang_args="{}")
    monkeypatch.setenv("WEIR_DEVICE", "cpu")  # the engine role gives SGLang this device (engines.factory)
    monkeypatch.setattr(engines.sglang_args, "routes_on_cpu", lambda: False)  # SGLang as installed, without CUDA
    assert engines_report_routes(config) is False
    monkeypatch.setattr(engines.sglang_args, "routes_on_cpu", lambda: True)  # one whose capture starts on the CPU
    assert engines_report_routes(config) is True
