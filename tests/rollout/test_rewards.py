"""Rewards: the built-ins, the registry of functions registered at start-up, and that a request can
never make the role import or run code it names."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from rollout.errors import UnknownReward
from rollout.plugins import PluginError
from rollout.rewards import ENTRY_POINT_GROUP, RewardRegistry, RewardSpec


def length_reward(response: str, reference: str | None, sample: Mapping[str, Any]) -> float:
    return float(len(response)) + (1.0 if reference == "bonus" else 0.0) + sample["sample_index"]


CONTEXT = {"group_id": "g", "prompt_index": 0, "sample_index": 0, "finish_reason": "stop", "response_ids": [1, 2]}


@pytest.mark.parametrize(
    "spec,response,expected",
    [
        (RewardSpec(type="none"), "anything", None),
        (RewardSpec(type="exact_match", answer="Left"), "  left. ", 1.0),
        (RewardSpec(type="exact_match", answer="left"), "right", 0.0),
        (RewardSpec(type="multiple_choice", answer="b"), "The answer is (B).", 1.0),
        (RewardSpec(type="multiple_choice", answer="B"), "C) certainly", 0.0),
        (RewardSpec(type="math", answer="2"), "so the result is $\\boxed{2}$", 1.0),
        (RewardSpec(type="math", answer="\\frac{1}{2}"), "0.5", 1.0),
        (RewardSpec(type="math", answer="3"), "$\\boxed{4}$", 0.0),
    ],
)
def test_builtin_rewards(spec: RewardSpec, response: str, expected: float | None) -> None:
    assert RewardRegistry().compute(spec, response, CONTEXT) == expected


def test_a_spec_must_be_complete() -> None:
    with pytest.raises(ValueError, match="needs an answer"):
        RewardSpec(type="exact_match")
    with pytest.raises(ValueError, match="registered reward function"):
        RewardSpec(type="custom")


def test_a_registered_function_is_called_by_name() -> None:
    registry = RewardRegistry({"length": length_reward})
    assert registry.names == ["length"]
    spec = RewardSpec(type="custom", function="length", answer="bonus")
    registry.check(spec)
    assert registry.compute(spec, "abc", {**CONTEXT, "sample_index": 2}) == 6.0


def test_load_from_settings_specs() -> None:
    registry = RewardRegistry.load({"length": f"{__name__}:length_reward"}, entry_point_group=None)
    assert registry.function("length") is length_reward


def test_an_unknown_name_lists_what_is_registered() -> None:
    registry = RewardRegistry({"length": length_reward})
    with pytest.raises(UnknownReward) as refused:
        registry.check(RewardSpec(type="custom", function="lenght"))
    assert refused.value.code == "unknown_reward_function"
    assert refused.value.registered == ["length"] and "length" in str(refused.value)


@pytest.mark.parametrize("path", ["builtins:print", "this:d", "os:system", "tests.services.rewards_for_tests:flaky"])
def test_a_dotted_path_in_a_request_is_refused_and_nothing_is_imported(
    path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    module = path.partition(":")[0]
    before = set(sys.modules)
    registry = RewardRegistry({"length": length_reward})
    spec = RewardSpec(type="custom", function=path)
    with pytest.raises(UnknownReward, match="never names code to import"):
        registry.check(spec)
    with pytest.raises(UnknownReward):
        registry.compute(spec, "response", CONTEXT)
    assert set(sys.modules) == before  # nothing was imported ("this" would print the Zen of Python)
    assert module in before or module not in sys.modules
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""  # print was not called, the Zen of Python not shown


def test_custom_names_cannot_shadow_builtins_or_look_like_paths() -> None:
    with pytest.raises(PluginError, match="built-in"):
        RewardRegistry({"math": length_reward})
    with pytest.raises(PluginError, match="not a usable name"):
        RewardRegistry({"pkg.mod:f": length_reward})


@pytest.mark.parametrize(
    "spec,problem",
    [
        ("no_colon", "is not 'package.module:function'"),
        ("tests.rollout.no_such_module:f", "does not import"),
        (f"{__name__}:no_such_function", "has no attribute"),
        (f"{__name__}:CONTEXT", "is not callable"),
    ],
)
def test_bad_specs_fail_at_load(spec: str, problem: str) -> None:
    with pytest.raises(PluginError, match=problem):
        RewardRegistry.load({"r": spec}, entry_point_group=None)


def test_entry_points_are_registered_and_settings_win(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real installed distribution (a dist-info folder on sys.path) declaring two ``weir.rewards``
    entry points; one is overridden by a settings spec of the same name."""
    package = tmp_path / "weir_reward_plugin"
    package.mkdir()
    (package / "__init__.py").write_text(
        textwrap.dedent(
            """
            def always_one(response, reference, sample):
                return 1.0

            def always_two(response, reference, sample):
                return 2.0
            """
        )
    )
    info = tmp_path / "weir_reward_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: weir-reward-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\none = weir_reward_plugin:always_one\ntwo = weir_reward_plugin:always_two\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = RewardRegistry.load({"two": f"{__name__}:length_reward"})
    assert {"one", "two"} <= set(registry.names)
    assert registry.compute(RewardSpec(type="custom", function="one"), "x", CONTEXT) == 1.0
    assert registry.function("two") is length_reward
    monkeypatch.delitem(sys.modules, "weir_reward_plugin", raising=False)


def test_a_broken_entry_point_stops_start_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    info = tmp_path / "broken_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nbroken = no_such_package_here:f\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError, match="entry point 'broken'"):
        RewardRegistry.load()
