"""OpenAI chat pieces of the rollout library: per-sample seeds, tool rendering and parsing, streamed deltas."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from experience.records import Sample, SampleStatus
from rollout import chat
from rollout.errors import InvalidPrompt
from rollout.group import sample_sampling, sample_seed
from rollout.prompts import PromptBuilder, parse_messages

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "the weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
HISTORY: list[dict[str, Any]] = [
    {"role": "developer", "content": "be brief"},
    {"role": "user", "content": "weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]


# -- seeds ----------------------------------------------------------------------------------------
def test_each_sample_of_a_seeded_group_has_its_own_reproducible_seed() -> None:
    seeds = [sample_seed(7, i) for i in range(8)]
    assert len(set(seeds)) == 8 and seeds == [sample_seed(7, i) for i in range(8)]
    assert all(0 <= s < 2**63 for s in seeds)
    assert set(seeds).isdisjoint(sample_seed(8, i) for i in range(8))  # not seed + i: groups do not overlap
    assert sample_sampling({"sampling_seed": 7, "temperature": 1.0}, 3) == {
        "sampling_seed": sample_seed(7, 3),
        "temperature": 1.0,
    }
    assert sample_sampling({"sampling_seed": 7.0}, 1) == {"sampling_seed": sample_seed(7, 1)}
    assert sample_sampling({"temperature": 1.0}, 3) == {"temperature": 1.0}  # unseeded stays unseeded
    assert sample_sampling({"sampling_seed": None}, 3) == {"sampling_seed": None}


# -- tools: input ---------------------------------------------------------------------------------
def test_tool_and_developer_roles_and_assistant_tool_calls_are_accepted() -> None:
    template, items = parse_messages(HISTORY)
    assert items == []
    assert template[0] == {"role": "system", "content": "be brief"}
    assert template[2] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "id": "call_1", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    }
    assert template[3] == {"role": "tool", "content": "sunny, 21 C"}


@pytest.mark.parametrize(
    "message,where",
    [
        ({"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]}, "name"),
        ({"role": "assistant", "tool_calls": "f"}, "tool_calls"),
        ({"role": "tool", "content": [{"type": "image_url", "image_url": {"url": "a.png"}}]}, "content"),
        ({"role": "user", "content": None}, "content"),
    ],
)
def test_malformed_tool_messages_are_refused_naming_the_field(message: dict[str, Any], where: str) -> None:
    with pytest.raises(InvalidPrompt, match=where):
        parse_messages([message])


def test_tools_render_as_qwen_renders_them(model: Path) -> None:
    builder = PromptBuilder(model)
    template, _ = parse_messages(HISTORY)
    text = builder.render(template, tools=TOOLS)
    assert text.startswith("<|im_start|>system\nbe brief\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in text
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        "<|im_end|>\n<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    ) in text
    assert text.endswith("<|im_start|>assistant\n")
    # The same conversation without tools: no tools block, the calls and results still rendered.
    plain = builder.render(template)
    assert "<tools>" not in plain and "<tool_response>" in plain and plain.startswith("<|im_start|>system\nbe brief")
    # A prefill starts the answer; the ids are the rendered text's.
    forced = builder.render(template, tools=TOOLS, prefill='<tool_call>\n{"name": "')
    assert forced == text + '<tool_call>\n{"name": "'
    assert builder.build(template, [], tools=TOOLS) == builder.tokenizer.encode(text, add_special_tokens=False)


def test_a_conversation_without_tools_renders_as_before(model: Path) -> None:
    builder = PromptBuilder(model)
    template, _ = parse_messages([{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}])
    assert (
        builder.render(template)
        == "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_template_that_ignores_tools_refuses_them(model: Path) -> None:
    builder = PromptBuilder(model)
    builder.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(InvalidPrompt) as refused:
        builder.render([{"role": "user", "content": "hi"}], tools=TOOLS)
    assert refused.value.code == "tools_not_supported"


# -- tools: output --------------------------------------------------------------------------------
def test_tool_calls_are_parsed_from_qwen_blocks() -> None:
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    content, calls = chat.parse_tool_calls(text)
    assert content == "Let me check.\n"  # the text before the first call, as vLLM's parser gives it
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    only, [call] = chat.parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert only is None and json.loads(call["function"]["arguments"]) == {"x": 1}


@pytest.mark.parametrize(
    "text",
    [
        "no call at all",
        '<tool_call>{"name": "f", "arguments": {</tool_call>',  # not JSON
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "f", "arguments": {}}',  # never closed
    ],
)
def test_text_that_is_not_a_whole_tool_call_is_content(text: str) -> None:
    assert chat.parse_tool_calls(text) == (text, [])


def _sample(text: str, ids: list[int], finish: str = "stop") -> Sample:
    return Sample(
        index=0,
        status=SampleStatus.OK,
        response_ids=ids,
        logprobs=[-0.5] * len(ids),
        text=text,
        finish_reason=finish,  # type: ignore[arg-type]
        policy_version=0,
    )


def test_a_completion_with_tool_calls() -> None:
    text = 'get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    whole = chat.completion(
        [_sample(text, [1, 2, 3])],
        completion_id="c",
        created=0,
        model="m",
        prompt_tokens=5,
        tools=True,
        prefill='<tool_call>\n{"name": "',
    )
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    chunks = chat.stream_chunks(whole, include_usage=True)
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[-3]["choices"][0]["delta"]["tool_calls"][0]["index"] == 0
    assert chunks[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    plain = chat.completion(
        [_sample("hello", [1])], completion_id="c", created=0, model="m", prompt_tokens=1, tools=True
    )
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": "hello"}
    assert plain["choices"][0]["finish_reason"] == "stop"


# -- streaming ------------------------------------------------------------------------------------
def test_a_choice_streams_one_delta_per_step_with_its_logprobs() -> None:
    stream = chat.ChoiceStream({"id": "c"}, 1, token_text=lambda t: f"<{t}>")
    first = stream.step([5], [-0.1], "He", None)
    assert [c["choices"][0]["delta"] for c in first] == [{"role": "assistant", "content": ""}, {"content": "He"}]
    assert first[1]["choices"][0]["logprobs"]["content"][0]["token"] == "<5>"
    assert all(c["choices"][0]["index"] == 1 for c in first)
    second = stream.step([6, 7], [-0.2, -0.3], "Hello", None)
    assert second[0]["choices"][0]["delta"] == {"content": "llo"}
    assert [e["logprob"] for e in second[0]["choices"][0]["logprobs"]["content"]] == [-0.2, -0.3]
    last = stream.step([], [], "Hello", _sample("Hello", [5, 6, 7], "length"))
    assert [c["choices"][0]["finish_reason"] for c in last] == ["length"]
    assert last[0]["choices"][0]["delta"] == {}


def test_text_that_may_be_a_stop_string_is_held_back() -> None:
    stream = chat.ChoiceStream({"id": "c"}, 0, stop=["END"])
    assert [c["choices"][0]["delta"] for c in stream.step([1], [-1.0], "abc E", None)][1:] == [{"content": "abc "}]
    assert stream.step([2], [-1.0], "abc EN", None) == []  # still maybe "END"
    assert stream.step([3], [-1.0], "abc ENDx", None) == []  # "END": nothing after it is sent
    last = stream.step([], [], "abc ENDx", _sample("abc ", [1, 2, 3]))  # the engine trimmed the stop string
    assert [c["choices"][0]["delta"] for c in last] == [{}]
    assert stream.sent == "abc "
    undecoded = chat.ChoiceStream({"id": "c"}, 0)
    assert [c["choices"][0]["delta"] for c in undecoded.step([1], [-1.0], "a\ufffd", None)][1:] == [{"content": "a"}]


def test_chat_max_tokens_default_to_what_the_context_leaves() -> None:
    from types import SimpleNamespace

    from rollout.group import Prepared, chat_max_tokens

    ctx: Any = SimpleNamespace(context_length=100)
    prepared = Prepared(
        prompt_ids=list(range(30)), media=[], inline=[], feature_keys=[], token_counts={"text": 30}, preprocess_s=0.0
    )
    assert chat_max_tokens(ctx, prepared, None) == 70  # not a fixed 256
    assert chat_max_tokens(ctx, prepared, 5) == 5
    with pytest.raises(InvalidPrompt) as beyond:
        chat_max_tokens(ctx, prepared, 71)
    assert beyond.value.code == "max_tokens_beyond_context"
    full: Any = SimpleNamespace(context_length=30)
    with pytest.raises(InvalidPrompt):  # a prompt that fills the context leaves no room for an answer
        chat_max_tokens(full, prepared, None)


def test_a_streamed_tool_call_is_sent_whole_once_parsed() -> None:
    stream = chat.ChoiceStream({"id": "c"}, 0, tools=True)
    text = ""
    out: list[dict[str, Any]] = []
    pieces = [
        "Let me",
        " check.\n<tool",
        '_call>\n{"name": "get_weather", ',
        '"arguments": {"city": "Rome"}}\n</tool_call>',
    ]
    for piece in pieces:
        text += piece
        out += stream.step([1], [-1.0], text, None)
    out += stream.step([], [], text, _sample(text, [1, 2, 3, 4]))
    deltas = [c["choices"][0]["delta"] for c in out]
    content = "".join(d.get("content") or "" for d in deltas)
    assert content == "Let me check.\n"  # the call's text is never sent as content
    [calls] = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert calls[0]["index"] == 0 and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    assert out[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # A forced call (prefill) holds everything back; an answer that is not a call ends as plain content.
    forced = chat.ChoiceStream({"id": "c"}, 0, tools=True, prefill='<tool_call>\n{"name": "')
    assert [c["choices"][0]["delta"] for c in forced.step([1], [-1.0], "get_", None)] == [
        {"role": "assistant", "content": ""}
    ]
    last = forced.step([], [], "get_", _sample("get_ broken", [1, 2]))
    assert last[0]["choices"][0]["delta"] == {"content": '<tool_call>\n{"name": "get_ broken'}
    assert last[-1]["choices"][0]["finish_reason"] == "stop"
