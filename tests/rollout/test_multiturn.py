"""Multi-turn rollouts without other roles: the turn loop against scripted engines (a `MockTransport` for the
engines and the preprocess role), and the trainer's loss on such a trajectory. The tools themselves:
test_tools.py; the registries' refusals: test_environments.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from engines.protocol import SamplingParams
from experience.microbatch import group_table
from experience.records import Group, SampleStatus
from preprocess.api import ItemResult, PreprocessRequest, PreprocessResponse
from preprocess.client import AsyncPreprocessClient
from rollout.admission import Admission
from rollout.context import PromptSpec, RolloutContext
from rollout.dispatch import Dispatcher
from rollout.environments import EnvironmentRegistry, VisualSearch
from rollout.group import rollout_group
from rollout.prompts import PromptBuilder
from rollout.rewards import RewardRegistry, RewardSpec
from rollout.sink import JsonlSink
from rollout.tools import Observation, ToolRegistry
from tests.rollout import hostile_tools
from trainer.feed import pack
from trainer.losses import LossConfig, policy_loss

KEY = "ab" * 20


# -- the turn loop against scripted engines -------------------------------------------------------
# The failing tools live in a module the sandbox's workers import quickly (this one imports torch).
slow, broken = hostile_tools.slow, hostile_tools.broken


class Scripted:
    """Engine answers in order (each a text the model 'generated', ending its turn), and every request."""

    def __init__(self, builder: PromptBuilder, texts: list[str], versions: list[str] | None = None) -> None:
        self.builder, self.texts, self.versions = builder, list(texts), list(versions or ["1"] * len(texts))
        self.bodies: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        text, version = self.texts.pop(0), self.versions.pop(0)
        ids = self.builder.tokenizer.encode(text, add_special_tokens=False)[: body["sampling_params"]["max_new_tokens"]]
        full = len(ids) < body["sampling_params"]["max_new_tokens"]
        if full:
            ids.append(self.builder.eos_ids[0])
        meta = {
            "finish_reason": {"type": "stop"} if full else {"type": "length"},
            "weight_version": version,
            "output_token_logprobs": [[-0.5, t, None] for t in ids],
        }
        return httpx.Response(200, json={"text": text, "output_ids": ids, "meta_info": meta})


def preprocess(request: httpx.Request) -> httpx.Response:
    items = PreprocessRequest.model_validate_json(request.content).items
    answered = [
        ItemResult(index=k, type=i.type, num_tokens=4, tokens_unbudgeted=4, key=KEY) for k, i in enumerate(items)
    ]
    return httpx.Response(200, content=PreprocessResponse(items=answered, num_tokens=4 * len(items)).model_dump_json())


@pytest.fixture()
def builder(model: Path) -> PromptBuilder:
    return PromptBuilder(model)


def context(builder: PromptBuilder, engine: Scripted, tmp_path: Path) -> RolloutContext:
    return RolloutContext(
        prompts=builder,
        dispatcher=Dispatcher(
            ["http://engine:1"], timeout_s=5, client=httpx.AsyncClient(transport=httpx.MockTransport(engine))
        ),
        preprocess=AsyncPreprocessClient(
            "http://pre", http=httpx.AsyncClient(base_url="http://pre", transport=httpx.MockTransport(preprocess))
        ),
        encoder=None,
        sink=JsonlSink(tmp_path / "x.jsonl"),
        rewards=RewardRegistry(),
        admission=Admission(max_media_tokens=10_000, max_bytes=1 << 20),
    )


CROP = '<tool_call>\n{"name": "crop", "arguments": {"x": 0, "y": 0, "w": 16, "h": 16}}\n</tool_call>'
CALC = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
MESSAGES = [{"role": "user", "content": "What is in the picture?"}]


def roll(builder: PromptBuilder, tmp_path: Path, texts: list[str], **spec: Any) -> tuple[Group, Scripted]:
    engine = Scripted(builder, texts, spec.pop("versions", None))
    ctx = context(builder, engine, tmp_path)
    max_new = spec.pop("max_new", 200)
    prompt = PromptSpec(messages=spec.pop("messages", MESSAGES), **spec)
    group = asyncio.run(
        rollout_group(ctx, prompt, index=0, sampling=SamplingParams(max_new_tokens=max_new), budget=None)
    )
    return group, engine


@pytest.fixture()
def visual(builder: PromptBuilder) -> Iterator[dict[str, Any]]:
    registry = ToolRegistry()
    environments = EnvironmentRegistry()
    yield {
        "environment": environments.resolve("visual_search", {"seed": 1, "size": 112, "patch": 8}),
        "tools": registry.resolve(["crop"]),
    }
    registry.close()


def test_a_crop_turn_then_an_answer_is_one_trajectory_with_exact_segments(
    builder: PromptBuilder, tmp_path: Path, visual: dict[str, Any]
) -> None:
    answer = VisualSearch(seed=1, size=112, patch=8)
    answer.reset(None)  # type: ignore[arg-type]
    group, engine = roll(builder, tmp_path, [CROP, answer.answer], versions=["3", "4"], max_turns=3, **visual)
    (sample,) = group.samples
    assert sample.status is SampleStatus.OK and sample.finish_reason == "stop" and sample.reward == 1.0
    assert sample.policy_version == 3 and sample.text == answer.answer
    first = builder.tokenizer.encode(CROP, add_special_tokens=False) + [builder.eos_ids[0]]
    second = builder.tokenizer.encode(answer.answer, add_special_tokens=False) + [builder.eos_ids[0]]
    observation = len(sample.response_ids) - len(first) - len(second)
    assert sample.loss_mask == [1] * len(first) + [0] * observation + [1] * len(second)
    assert sample.response_ids[: len(first)] == first and sample.response_ids[-len(second) :] == second
    assert sample.logprobs == [-0.5] * len(first) + [0.0] * observation + [-0.5] * len(second)
    assert sample.token_versions == [3] * (len(first) + observation) + [4] * len(second)
    # The observation is exactly the template's rendering of the tool turn (its image in a user turn,
    # as this template renders images there), its placeholder expanded to the image's 4 tokens.
    segment = sample.response_ids[len(first) : len(first) + observation]
    image = builder.placeholders["image"]
    assert segment.count(image) == 4 and sample.feature_keys == [KEY]
    collapsed = [t for k, t in enumerate(segment) if t != image or segment[k - 1] != image]
    text = builder.tokenizer.decode(collapsed, skip_special_tokens=False)
    assert text == (
        "\n<|im_start|>user\n<tool_response>\n\n</tool_response><|im_end|>\n<|im_start|>user\n"
        "<|vision_bos|><|IMAGE|><|vision_eos|><|im_end|>\n<|im_start|>assistant\n"
    )
    # The prompt: the environment's picture (4 tokens), its tools rendered; the second turn's engine
    # body holds the whole sequence and both media in order.
    assert group.token_counts["image"] == 4 + 4 and len(group.feature_keys) == 1
    assert "crop" in builder.tokenizer.decode(group.prompt_ids)
    assert engine.bodies[1]["input_ids"] == group.prompt_ids + sample.response_ids[: len(first) + observation]
    assert len(engine.bodies[1]["weir_media"]) == 2
    assert engine.bodies[1]["sampling_params"]["max_new_tokens"] == 200 - len(first) - observation


def test_a_text_observation_is_the_template_difference(builder: PromptBuilder, tmp_path: Path) -> None:
    registry = ToolRegistry()
    group, _ = roll(builder, tmp_path, [CALC, "42"], tools=registry.resolve(["calculator"]), max_turns=2)
    (sample,) = group.samples
    mask = sample.loss_mask or []
    segment = [t for t, m in zip(sample.response_ids, mask, strict=True) if m == 0]
    assert builder.tokenizer.decode(segment, skip_special_tokens=False) == (
        "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert sample.finish_reason == "stop" and sample.reward is None  # no reward spec: none


def test_max_turns_ends_a_trajectory_that_still_calls(builder: PromptBuilder, tmp_path: Path) -> None:
    registry = ToolRegistry()
    group, engine = roll(builder, tmp_path, [CALC, CALC], tools=registry.resolve(["calculator"]), max_turns=2)
    assert group.samples[0].finish_reason == "max_turns" and len(engine.bodies) == 2


def test_a_bad_call_is_an_error_observation_and_the_trajectory_goes_on(builder: PromptBuilder, tmp_path: Path) -> None:
    registry = ToolRegistry()
    bad = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "__import__(1)"}}\n</tool_call>'
    group, _ = roll(
        builder,
        tmp_path,
        [bad, "done"],
        tools=registry.resolve(["calculator"]),
        reward=RewardSpec(type="exact_match", answer="done"),
    )
    sample = group.samples[0]
    segment = [t for t, m in zip(sample.response_ids, sample.loss_mask or [], strict=True) if m == 0]
    assert "error: only numbers" in builder.tokenizer.decode(segment)
    assert sample.finish_reason == "stop" and sample.reward == 1.0


@pytest.mark.parametrize("which", ["slow", "broken"])
def test_a_failing_tool_ends_the_trajectory_with_tool_error(builder: PromptBuilder, tmp_path: Path, which: str) -> None:
    registry = ToolRegistry({which: globals()[which]}, timeout_s=0.5)
    call = '<tool_call>\n{"name": "' + which + '", "arguments": {}}\n</tool_call>'
    group, engine = roll(
        builder,
        tmp_path,
        [call, "unused"],
        tools=registry.resolve([which]),
        reward=RewardSpec(type="exact_match", answer="x"),
    )
    sample = group.samples[0]
    assert sample.status is SampleStatus.OK and sample.finish_reason == "tool_error" and sample.reward is None
    assert which in (sample.error or "") and not sample.trainable and len(engine.bodies) == 1
    registry.close()


def test_the_response_budget_spans_turns(builder: PromptBuilder, tmp_path: Path) -> None:
    registry = ToolRegistry()
    first = len(builder.tokenizer.encode(CALC, add_special_tokens=False)) + 1
    group, engine = roll(builder, tmp_path, [CALC, "x"], tools=registry.resolve(["calculator"]), max_new=first + 5)
    sample = group.samples[0]  # the observation does not fit what is left: the trajectory ends before it
    assert sample.finish_reason == "length" and sample.loss_mask == [1] * first and len(engine.bodies) == 1


# -- the trainer's side --------------------------------------------------------------------------------
def test_the_policy_loss_has_no_gradient_on_observation_tokens(
    builder: PromptBuilder, tmp_path: Path, visual: dict[str, Any]
) -> None:
    """A multi-turn trajectory through the data role's rows (`group_table`) and the trainer's tensors
    (`pack`): the policy loss's gradient w.r.t. the logits is zero at every observation position (and
    at the prompt's), non-zero at the model's tokens."""
    group, _ = roll(builder, tmp_path, [CROP, "red"], max_turns=3, **visual)
    sample = group.samples[0]
    group = Group(
        group_id=group.group_id,
        prompt_ids=group.prompt_ids,
        feature_keys=group.feature_keys,
        samples=[dataclass_replace(sample, reward=1.0)],
    )
    table = group_table(group, [1.0])
    assert table.column("feature_keys").to_pylist() == [[KEY, KEY]]
    t = pack(table)
    ids = t["input_ids"]
    vocab = len(builder.tokenizer)
    logits = torch.randn(len(ids), vocab, requires_grad=True)
    # The logits at position i predict token i + 1 (as the reference trainer shifts them).
    logprobs = torch.log_softmax(logits[:-1], -1).gather(1, ids[1:, None])[:, 0]
    mask = t["loss_mask"][1:]
    out = policy_loss(
        logprobs,
        logprobs.detach(),
        t["advantages"][1:],
        mask,
        LossConfig(),
        rollout_logprobs=t["rollout_logprobs"][1:],
    )
    out.loss.backward()
    assert logits.grad is not None
    norms = logits.grad[:-1].abs().sum(-1)
    assert torch.all(norms[mask == 0] == 0) and torch.all(norms[mask == 1] > 0)
    assert int((mask == 0).sum()) > len(group.prompt_ids)  # observation tokens are among the zeros


def dataclass_replace(sample: Any, **changes: Any) -> Any:
    import dataclasses

    return dataclasses.replace(sample, **changes)


class Dialogue:
    """A test environment: the first answer gets a "try again" turn (with a picture), the second is judged."""

    tools: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}
        self.answers = 0

    def reset(self, info: Any) -> None:
        return None

    def step(self, action: Any) -> Any:
        self.answers += 1
        if self.answers == 1:
            return Observation(text="try again", images=(b"png bytes",)), 0.25, False
        return None, 1.0, True


def test_an_environment_turn_continues_the_conversation_and_rewards_add_up(
    builder: PromptBuilder, tmp_path: Path
) -> None:
    environment = EnvironmentRegistry({"dialogue": Dialogue}).resolve("dialogue")
    group, engine = roll(builder, tmp_path, ["one", "two"], environment=environment, max_turns=3)
    sample = group.samples[0]
    assert sample.finish_reason == "stop" and sample.reward == 1.25 and len(engine.bodies) == 2
    segment = [t for t, m in zip(sample.response_ids, sample.loss_mask or [], strict=True) if m == 0]
    image = builder.placeholders["image"]
    collapsed = [t for k, t in enumerate(segment) if t != image or segment[k - 1] != image]
    assert builder.tokenizer.decode(collapsed, skip_special_tokens=False) == (
        "\n<|im_start|>user\n<|vision_bos|><|IMAGE|><|vision_eos|>try again<|im_end|>\n<|im_start|>assistant\n"
    )
    assert segment.count(image) == 4 and sample.feature_keys == [KEY] and group.token_counts["image"] == 4


def test_settings_register_tools_and_environments_by_spec_only(model: Path) -> None:
    from pydantic import ValidationError

    from services.rollout.service import build_plugins
    from services.rollout.settings import RolloutSettings

    settings = RolloutSettings(
        model=model,
        tools="broken=tests.rollout.test_multiturn:broken",
        environments="dialogue=tests.rollout.test_multiturn:Dialogue",
        http_environments="remote=http://127.0.0.1:9/env",
    )
    tools, environments = build_plugins(settings)
    assert tools.names == ["broken", "calculator", "crop"]
    assert environments.names == ["dialogue", "remote", "visual_search"]
    tools.close()
    for field, value in (("tools", "x=nope.nowhere:f"), ("environments", "bad"), ("http_environments", "r=ftp://x")):
        with pytest.raises(ValidationError, match=f"WEIR_{field.upper()}"):
            RolloutSettings(model=model, **{field: value})
