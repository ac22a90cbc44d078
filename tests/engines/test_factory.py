"""`engines.load_engine` for SGLang: the server arguments it starts `sglang.Engine` with.

SGLang needs CUDA and is not installed here, so `sglang` is a stand-in module that records the keyword
arguments `sglang.Engine` is called with (its `ServerArgs` fields)."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

from engines.factory import load_engine
from services.engine.settings import EngineSettings


class _Recorder:
    calls: list[dict[str, Any]] = []

    def __init__(self, **kwargs: Any) -> None:
        _Recorder.calls.append(kwargs)


@pytest.fixture()
def sglang(monkeypatch: pytest.MonkeyPatch) -> type[_Recorder]:
    _Recorder.calls = []
    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=_Recorder))
    return _Recorder


def test_routed_experts_start_sglang_able_to_return_them(sglang: type[_Recorder], tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"vocab_size": 100, "max_position_embeddings": 64}')
    engine = load_engine(tmp_path, backend="sglang", device="cuda", max_running=4, routed_experts=True)
    assert engine.limits.vocab_size == 100  # type: ignore[attr-defined]
    load_engine(tmp_path, backend="sglang")
    assert sglang.calls == [
        {
            "model_path": str(tmp_path),
            "device": "cuda",
            "max_running_requests": 4,
            "enable_return_routed_experts": True,  # SGLang's ServerArgs field (--enable-return-routed-experts)
        },
        {"model_path": str(tmp_path)},  # SGLang's own defaults otherwise
    ]


def test_the_engine_role_setting_is_the_rollout_roles_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setenv("WEIR_MODEL", str(tmp_path))
    assert EngineSettings().return_routed_experts is False
    monkeypatch.setenv("WEIR_RETURN_ROUTED_EXPERTS", "true")  # what `weir train --r3` sets for every role
    assert EngineSettings().return_routed_experts is True
