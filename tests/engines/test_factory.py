"""`engines.load_engine` for SGLang: the server arguments it starts `sglang.Engine` with.

SGLang needs CUDA and is not installed here, so `sglang` is a stand-in module whose `Engine` (the rule-keeping
stand-in, `sglang_standin`) records the keyword arguments it is called with (its `ServerArgs` fields)."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

from engines.factory import load_engine
from services.engine.settings import EngineSettings

from . import sglang_standin as standin


class _Recorder(standin.Engine):
    calls: list[dict[str, Any]] = []

    def __init__(self, **kwargs: Any) -> None:
        _Recorder.calls.append(kwargs)
        super().__init__(**kwargs)


@pytest.fixture()
def sglang(monkeypatch: pytest.MonkeyPatch) -> type[_Recorder]:
    _Recorder.calls = []
    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=_Recorder))
    monkeypatch.setitem(sys.modules, "sglang.srt", types.SimpleNamespace())
    monkeypatch.setitem(sys.modules, "sglang.srt.managers", types.SimpleNamespace(io_struct=standin.io_struct))
    return _Recorder


def test_routed_experts_start_sglang_able_to_return_them(sglang: type[_Recorder], tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"vocab_size": 100, "max_position_embeddings": 64}')
    engine = load_engine(tmp_path, backend="sglang", device="cuda", max_running=4, routed_experts=True)
    assert engine.limits.vocab_size == 100  # type: ignore[attr-defined]
    engine.close()
    load_engine(tmp_path, backend="sglang", server_args={"tp_size": 2, "context_length": 32}).close()
    assert sglang.calls == [
        {
            "model_path": str(tmp_path),
            "weight_version": "0",  # Weir's first version; SGLang's own default is "default"
            "device": "cuda",
            "max_running_requests": 4,
            "enable_return_routed_experts": True,  # SGLang's ServerArgs field (--enable-return-routed-experts)
        },
        {"model_path": str(tmp_path), "weight_version": "0", "tp_size": 2, "context_length": 32},
    ]


def test_a_setting_and_a_server_argument_that_disagree_are_refused(sglang: type[_Recorder], tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="max_running_requests=8 contradicts WEIR_MAX_RUNNING=4"):
        load_engine(tmp_path, backend="sglang", max_running=4, server_args={"max_running_requests": 8})
    with pytest.raises(ValueError, match="model_path: set by Weir"):
        load_engine(tmp_path, backend="sglang", server_args={"model_path": "/elsewhere"})
    assert sglang.calls == []
    load_engine(tmp_path, backend="sglang", max_running=4, server_args={"max_running_requests": 4}).close()


def test_the_engine_role_setting_is_the_rollout_roles_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setenv("WEIR_MODEL", str(tmp_path))
    assert EngineSettings().return_routed_experts is False
    monkeypatch.setenv("WEIR_RETURN_ROUTED_EXPERTS", "true")  # what `weir train --r3` sets for every role
    assert EngineSettings().return_routed_experts is True


def test_sglang_server_arguments_as_a_setting(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """WEIR_SGLANG_ARGS (a JSON object, empty as compose leaves it) and WEIR_ENGINE_GPUS (compose's GPU
    reservation), which is the engine's tp_size unless told otherwise and must be all the GPUs it takes."""
    from pydantic import ValidationError

    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setenv("WEIR_MODEL", str(tmp_path))
    monkeypatch.setenv("WEIR_BACKEND", "sglang")
    monkeypatch.setenv("WEIR_SGLANG_ARGS", "")
    assert EngineSettings().sglang_args == {}
    monkeypatch.setenv("WEIR_ENGINE_GPUS", "2")
    assert EngineSettings().sglang_args == {"tp_size": 2}
    monkeypatch.setenv("WEIR_SGLANG_ARGS", '{"tp_size": 1, "dp_size": 2, "mem_fraction_static": 0.8}')
    assert EngineSettings().sglang_args["dp_size"] == 2
    for bad, message in (
        ('{"tp_size": 4}', "needs 4 GPUs per engine"),
        ('{"incremental_streaming_output": true}', "set by Weir"),
        ("[2]", "JSON object"),
    ):
        monkeypatch.setenv("WEIR_SGLANG_ARGS", bad)
        with pytest.raises(ValidationError, match=message):
            EngineSettings()
    monkeypatch.setenv("WEIR_SGLANG_ARGS", '{"tp_size": 2}')
    monkeypatch.setenv("WEIR_BACKEND", "transformers")
    with pytest.raises(ValidationError, match="WEIR_SGLANG_ARGS is for WEIR_BACKEND=sglang"):
        EngineSettings()


def test_each_local_sglang_engine_gets_its_own_gpus() -> None:
    from launcher.stack import engine_devices
    from services.settings import SettingsError

    assert engine_devices(0, {"WEIR_BACKEND": "transformers"}) == {}
    tp2 = {"WEIR_BACKEND": "sglang", "WEIR_SGLANG_ARGS": '{"tp_size": 2}'}
    assert engine_devices(0, tp2) == {"CUDA_VISIBLE_DEVICES": "0,1", "WEIR_ENGINE_GPUS": "2"}
    assert engine_devices(1, tp2)["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert engine_devices(1, {**tp2, "CUDA_VISIBLE_DEVICES": "4,5,6,7"})["CUDA_VISIBLE_DEVICES"] == "6,7"
    with pytest.raises(SettingsError, match="engine 2 takes 2 GPUs"):
        engine_devices(2, {**tp2, "CUDA_VISIBLE_DEVICES": "4,5,6,7"})


def test_ray_gives_an_sglang_engine_all_the_gpus_it_takes() -> None:
    from launcher.cluster.stack import RayStack

    stack = RayStack(engines=2, env={"WEIR_BACKEND": "sglang", "WEIR_SGLANG_ARGS": '{"tp_size": 2, "pp_size": 2}'})
    assert stack.plan(engine_nodes=1, use_gpus=True)["engine"].num_gpus == 4.0
    assert stack.plan(engine_nodes=1, use_gpus=False)["engine"].num_gpus == 0.0  # no GPUs: CPU slots instead
    assert RayStack(engines=2).plan(engine_nodes=1, use_gpus=True)["engine"].num_gpus == 1.0
