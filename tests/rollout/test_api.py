"""The library's public API, pinned; and that it is a library: importing it starts no web framework."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import rollout


def test_public_api() -> None:
    assert sorted(rollout.__all__) == sorted(
        [
            "BUILTIN_REWARDS",
            "EnvironmentRegistry",
            "Observation",
            "ToolContext",
            "ToolError",
            "ToolRegistry",
            "rollout_multiturn",
            "DEFAULT_ROLLOUT_FUNCTION",
            "ENTRY_POINT_GROUP",
            "Admission",
            "ChatStream",
            "ChoiceLogprobs",
            "Dispatcher",
            "EngineEndpoint",
            "EngineHealth",
            "EngineRefused",
            "EngineStream",
            "EnginesUnavailable",
            "ExperienceRefused",
            "HttpSink",
            "InvalidPrompt",
            "JsonlSink",
            "LogprobAsk",
            "MediaRefused",
            "Overloaded",
            "PluginError",
            "Prepared",
            "ChoiceStep",
            "PromptBuilder",
            "PromptSpec",
            "RewardContext",
            "RewardFunction",
            "RewardRegistry",
            "RewardSpec",
            "RolloutContext",
            "RolloutError",
            "RolloutFunction",
            "Sink",
            "UnknownReward",
            "UpstreamUnauthorized",
            "UpstreamUnavailable",
            "WorkTooLarge",
            "chat_samples",
            "chat_stream",
            "generate_n",
            "parse_messages",
            "prepare",
            "reward_samples",
            "rollout_group",
            "run_prompt",
            "sample_seed",
        ]
    )
    assert all(hasattr(rollout, name) for name in rollout.__all__)
    assert rollout.DEFAULT_ROLLOUT_FUNCTION == "rollout.group:rollout_group"


def test_every_error_has_a_stable_code() -> None:
    errors = [getattr(rollout, name) for name in rollout.__all__ if name.endswith(("Error", "Refused", "Unavailable"))]
    errors += [rollout.InvalidPrompt, rollout.UnknownReward, rollout.Overloaded, rollout.WorkTooLarge]
    errors += [rollout.UpstreamUnauthorized]
    for error in errors:
        if issubclass(error, rollout.RolloutError):
            assert error.code and error.code.islower(), error


def test_the_library_imports_no_web_framework() -> None:
    code = "import sys, rollout; bad = [m for m in ('fastapi', 'starlette', 'uvicorn') if m in sys.modules]; print(bad)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        cwd=Path(__file__).parents[2],
    )
    assert out.stdout.strip() == "[]", out.stderr
