"""The built-in tools: the calculator computes arithmetic and refuses anything else; crop cuts the
environment's picture and refuses a region outside it."""

from __future__ import annotations

import asyncio

import pytest

from rollout.environments import VisualSearch
from rollout.tools import ToolContext, ToolError, ToolRegistry, calculator, evaluate


def test_the_calculator_computes_arithmetic() -> None:
    context = ToolContext()
    assert calculator({"expression": "(3 + 4) * 12"}, context) == "84"
    assert calculator({"expression": "7 / 2"}, context) == "3.5"
    assert calculator({"expression": "-2 ** 3 % 5"}, context) == str(-(2**3) % 5)


@pytest.mark.parametrize(
    "expression",
    [
        "__import__('os').system('echo hi')",
        "().__class__.__bases__",
        "open('/etc/passwd')",
        "x + 1",
        "'a' * 3",
        "[1, 2]",
        "lambda: 1",
        "2 ** 100000",
        "1 / 0",
        "9" * 300,
    ],
)
def test_the_calculator_refuses_anything_but_arithmetic(expression: str) -> None:
    with pytest.raises(ToolError):
        evaluate(expression)


def test_crop_cuts_the_environment_picture_and_refuses_a_region_outside() -> None:
    env = VisualSearch(seed=3, size=112, patch=8)
    env.reset(None)  # type: ignore[arg-type]
    registry = ToolRegistry()
    crop = registry.get("crop")
    context = ToolContext(state=env.state)
    out = asyncio.run(crop.run({"x": 10, "y": 20, "w": 30, "h": 40}, context))
    assert out.images[0].size == (30, 40) and out.text == ""
    for bad in ({"x": 100, "y": 0, "w": 30, "h": 5}, {"x": 0, "y": 0, "w": "9", "h": 5}, {"x": 0}):
        with pytest.raises(ToolError):
            asyncio.run(crop.run(bad, context))
    x, y = env.state["patch_xy"]
    assert env.step("  " + env.answer.upper() + ".") == (None, 1.0, True)
    assert env.step("purple")[1] == 0.0 and (x, y) == env.state["patch_xy"]
