"""An observation's media count against the in-flight admission bound like a prompt's: admitted for its
sample, held until the trajectory ends, and over the bound (now or always) the sample ends ``tool_error``
naming the refusal — one sample, never the request."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engines.protocol import SamplingParams
from experience.records import Group, SampleStatus
from rollout.admission import Admission
from rollout.context import PromptSpec
from rollout.environments import EnvironmentRegistry, VisualSearch
from rollout.group import rollout_group
from rollout.prompts import PromptBuilder
from rollout.tools import ToolRegistry
from tests.rollout.test_multiturn import CROP, MESSAGES, Dialogue, Scripted, context


@pytest.fixture()
def builder(model: Path) -> PromptBuilder:
    return PromptBuilder(model)


def roll(
    builder: PromptBuilder, tmp_path: Path, admission: Admission, texts: list[str], **spec: Any
) -> tuple[Group, list[int]]:
    """The group, and the media tokens admitted at each engine call (what was held while generating)."""
    engine = Scripted(builder, texts)
    held: list[int] = []

    def watching(request: Any) -> Any:
        held.append(admission.media_tokens)
        return engine(request)

    ctx = context(builder, watching, tmp_path)  # type: ignore[arg-type]  # any callable answers
    ctx.admission = admission
    prompt = PromptSpec(messages=MESSAGES, **spec)
    group = asyncio.run(rollout_group(ctx, prompt, index=0, sampling=SamplingParams(max_new_tokens=200), budget=None))
    return group, held


@pytest.fixture()
def visual() -> Iterator[dict[str, Any]]:
    tools = ToolRegistry()
    yield {
        "environment": EnvironmentRegistry().resolve("visual_search", {"seed": 1, "size": 112, "patch": 8}),
        "tools": tools.resolve(["crop"]),
        "max_turns": 3,
    }
    tools.close()


def test_an_observation_image_is_admitted_held_while_generating_and_released(
    builder: PromptBuilder, tmp_path: Path, visual: dict[str, Any]
) -> None:
    answer = VisualSearch(seed=1, size=112, patch=8)
    answer.reset(None)  # type: ignore[arg-type]
    admission = Admission(max_media_tokens=8, max_bytes=1 << 20)
    group, held = roll(builder, tmp_path, admission, [CROP, answer.answer], **visual)
    (sample,) = group.samples
    assert sample.finish_reason == "stop" and sample.reward == 1.0
    assert held == [4, 4 + 4]  # the prompt's picture, then the crop's too, while the second turn generated
    assert admission.media_tokens == 0


def test_an_observation_over_the_bound_now_ends_its_sample_overloaded(
    builder: PromptBuilder, tmp_path: Path, visual: dict[str, Any]
) -> None:
    admission = Admission(max_media_tokens=4, max_bytes=1 << 20)  # the prompt's picture fills it
    group, held = roll(builder, tmp_path, admission, [CROP, "unused"], **visual)
    (sample,) = group.samples
    assert sample.status is SampleStatus.OK and sample.finish_reason == "tool_error" and sample.reward is None
    assert "(overloaded)" in (sample.error or "") and held == [4]
    assert admission.media_tokens == 0


def test_an_observation_over_the_bound_alone_ends_its_sample_work_too_large(
    builder: PromptBuilder, tmp_path: Path
) -> None:
    environment = EnvironmentRegistry({"dialogue": Dialogue}).resolve("dialogue")  # type: ignore[dict-item]
    admission = Admission(max_media_tokens=3, max_bytes=1 << 20)  # a text prompt; the observation's image is 4
    group, held = roll(builder, tmp_path, admission, ["one", "two"], environment=environment, max_turns=3)
    (sample,) = group.samples
    assert sample.finish_reason == "tool_error" and "(work_too_large)" in (sample.error or "")
    assert held == [0] and admission.media_tokens == 0
