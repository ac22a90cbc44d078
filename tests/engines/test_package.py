"""The engines package: its public API is pinned, its errors are one tree, it does not speak HTTP."""

from __future__ import annotations

import ast
from pathlib import Path

import engines
from engines.errors import EngineError, InvalidSampling


def test_the_errors_are_one_tree_of_value_errors() -> None:
    assert issubclass(InvalidSampling, EngineError) and issubclass(EngineError, ValueError)
    for name in ("InvalidSampling", "InvalidEnginePrompt", "InvalidMedia", "MediaNotFound", "WeightsError"):
        assert issubclass(getattr(engines, name), engines.EngineError)


def test_public_api() -> None:
    assert set(engines.__all__) == {
        "DEFAULT_MAX_RUNNING",
        "IGNORED_SAMPLING",
        "KNOWN_SAMPLING",
        "PAUSE_MODES",
        "REFUSED_SAMPLING",
        "SUPPORTED_SAMPLING",
        "Backend",
        "Engine",
        "EngineError",
        "GenerateRequest",
        "GenerateResult",
        "InvalidMedia",
        "InvalidEnginePrompt",
        "InvalidSampling",
        "MediaInput",
        "MediaKind",
        "MediaNotFound",
        "MediaRef",
        "MediaResolver",
        "ModelLimits",
        "PauseMode",
        "SamplingParams",
        "TokenCallback",
        "TopLogprobs",
        "WeightsError",
        "load_engine",
        "sample_count",
        "sample_seed",
        "sampling_from",
    }


def test_the_library_never_imports_http_frameworks() -> None:
    for module in Path(engines.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(module.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not {n.split(".")[0] for n in names} & {"fastapi", "starlette", "services"}, module
