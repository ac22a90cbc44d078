"""The registries a request's names are looked up in: an unknown tool or environment is refused by
name, and an environment names the tools it offers."""

from __future__ import annotations

import pytest

from rollout.environments import EnvironmentRegistry
from rollout.errors import InvalidPrompt
from rollout.tools import ToolRegistry


def test_unknown_names_are_refused_naming_them() -> None:
    registry = ToolRegistry()
    with pytest.raises(InvalidPrompt) as refused:
        registry.resolve(["calculator", "shell"])
    assert refused.value.code == "unknown_tool" and "'shell'" in str(refused.value) and "tools[1]" in str(refused.value)
    with pytest.raises(InvalidPrompt, match="'builtins:print'"):
        EnvironmentRegistry().resolve("builtins:print")
    assert EnvironmentRegistry().tools_of("visual_search") == ("crop",)
