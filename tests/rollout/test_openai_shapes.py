"""OpenAI chat pieces of the rollout library: per-sample seeds, tool rendering and parsing, streamed deltas."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engines.protocol import SamplingParams
from engines.sampling import sampling_from
from experience.records import Sample, SampleStatus
from rollout import chat
from rollout.errors import InvalidPrompt
from rollout.generation import sample_sampling, sample_seed
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
    assert sample_sampling(SamplingParams(sampling_seed=7, temperature=1.0), 3) == SamplingParams(
        sampling_seed=sample_seed(7, 3),
        temperature=1.0,
    )
    assert sample_sampling(sampling_from({"sampling_seed": 7.0}), 1) == SamplingParams(sampling_seed=sample_seed(7, 1))
    unseeded = SamplingParams(temperature=1.0)
    assert sample_sampling(unseeded, 3) == SamplingParams(temperature=1.0)  # unseeded stays unseeded
    assert sample_sampling(SamplingParams(sampling_seed=None), 3) == SamplingParams(sampling_seed=None)


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

    from rollout.preparation import Prepared
    from rollout.serving import chat_max_tokens

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


# -- top log-probs and the prompt's log-probs -----------------------------------------------------
def _answer(ids: list[int], *, final: bool = True, tops: int | None = None, prompt: bool = False) -> dict[str, Any]:
    """An engine's /generate answer (or stream chunk) in SGLang's shape, with ``tops`` positions of top log-probs."""
    meta: dict[str, Any] = {
        "finish_reason": {"type": "length"} if final else None,
        "weight_version": "0",
        "output_token_logprobs": [[-0.5, t, None] for t in ids],
    }
    if tops is not None:
        meta["output_top_logprobs"] = [[[-0.25, 7, None], [-0.5, ids[k], None]] for k in range(tops)]
    if prompt:
        meta["input_token_logprobs"] = [[None, 1, None], [-1.0, 2, None], [-2.0, 3, None]]
        meta["input_top_logprobs"] = [None, [[-0.5, 2, None]], [[-1.5, 4, None]]]
    return {"text": "x" * len(ids), "output_ids": ids, "meta_info": meta}


def test_the_engines_top_and_prompt_logprobs_are_read_and_checked() -> None:
    from rollout.logprobs import LogprobAsk, choice_logprobs

    both = LogprobAsk(top=2, prompt=True)
    details = choice_logprobs(_answer([5, 6], tops=2, prompt=True), both, prompt_ids=[1, 2, 3])
    assert details.top == [[(-0.25, 7), (-0.5, 5)], [(-0.25, 7), (-0.5, 6)]]
    assert details.prompt == [(None, 1), (-1.0, 2), (-2.0, 3)]
    assert details.prompt_top == [None, [(-0.5, 2)], [(-1.5, 4)]]
    for answer, why in (
        (_answer([5, 6], tops=1, prompt=True), "1 top log-prob positions for 2 tokens"),
        (_answer([5, 6], prompt=True), "no output_top_logprobs"),
        (_answer([5, 6], tops=2), "no input_token_logprobs"),
    ):
        with pytest.raises(ValueError, match=why):
            choice_logprobs(answer, both, prompt_ids=[1, 2, 3])
    with pytest.raises(ValueError, match="do not cover"):
        choice_logprobs(_answer([5], tops=1, prompt=True), both, prompt_ids=[1, 2, 9])
    with pytest.raises(ValueError, match="where 1 to 1 were asked"):  # more alternatives than asked
        choice_logprobs(_answer([5], tops=1), LogprobAsk(top=1), prompt_ids=[1])


def test_the_engine_body_asks_for_what_the_request_shows() -> None:
    from rollout.dispatch import EngineEndpoint
    from rollout.generation import engine_body
    from rollout.logprobs import LogprobAsk
    from rollout.preparation import Prepared

    prepared = Prepared(prompt_ids=[1, 2], media=[], inline=[], feature_keys=[], token_counts={}, preprocess_s=0)
    for url in ("http://e:1", "sglang+http://e:1"):
        body = engine_body(EngineEndpoint.parse(url), prepared, SamplingParams(), "g/0", routed_experts=False)
        assert "top_logprobs_num" not in body.model_fields_set and "logprob_start_len" not in body.model_fields_set
        asked = engine_body(
            EngineEndpoint.parse(url),
            prepared,
            SamplingParams(),
            "g/0",
            routed_experts=False,
            ask=LogprobAsk(top=3, prompt=True),
        )
        assert asked.top_logprobs_num == 3 and asked.logprob_start_len == 0 and asked.return_logprob


class _FakeStream:
    def __init__(self, chunks: list[dict[str, Any]]) -> None:
        self._chunks = chunks
        self.engine = type("E", (), {"url": "http://e"})()

    async def chunks(self) -> Any:
        for chunk in self._chunks:
            yield chunk

    async def aclose(self) -> None:
        return None


def test_a_stream_step_waits_for_its_tokens_top_logprobs() -> None:
    import asyncio
    import contextlib

    from rollout.logprobs import LogprobAsk
    from rollout.preparation import Prepared
    from rollout.serving import ChatStream

    prepared = Prepared(prompt_ids=[1, 2, 3], media=[], inline=[], feature_keys=[], token_counts={}, preprocess_s=0)
    chunks = [
        _answer([5], final=False, tops=1),  # a plain SGLang server: each chunk has them
        _answer([5, 6], final=False),  # Weir's engine: only the final one has them; this one waits
        _answer([5, 6, 8], final=False, tops=2),  # still one short: waits
        _answer([5, 6, 8, 9], tops=4, prompt=True),
    ]
    stream: Any = _FakeStream(chunks)

    async def steps(ask: LogprobAsk) -> list[Any]:
        streams = ChatStream(
            "g", prepared, [_FakeStream(chunks) if ask.prompt else stream], contextlib.ExitStack(), ask
        )
        return [step async for step in streams.progress()]

    out = asyncio.run(steps(LogprobAsk(top=2)))
    assert [s.token_ids for s in out] == [[5], [6, 8, 9]]
    assert [len(s.details.top) for s in out] == [1, 3] and out[-1].sample is not None
    assert out[1].details.top[0] == [(-0.25, 7), (-0.5, 6)]
    echoed = asyncio.run(steps(LogprobAsk(top=2, prompt=True)))  # the prompt's come with the final chunk
    assert [s.token_ids for s in echoed] == [[5, 6, 8, 9]]
    assert echoed[0].details.prompt == [(None, 1), (-1.0, 2), (-2.0, 3)]


def test_response_format_and_top_logprobs_of_a_request() -> None:
    from rollout.api import ChatRequest, CompletionRequest
    from services.errors import ApiError
    from services.rollout.service import (
        chat_logprobs,
        completion_logprobs,
        response_format_sampling,
        unsupported_parameter,
    )

    def request(**fields: Any) -> ChatRequest:
        return ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})

    assert response_format_sampling(request()) == {}
    assert response_format_sampling(request(response_format={"type": "text"})) == {}
    assert response_format_sampling(request(response_format={"type": "json_object"})) == {"json_schema": "$$ANY$$"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    shaped = request(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    assert json.loads(response_format_sampling(shaped)["json_schema"]) == schema
    assert unsupported_parameter(shaped) is None
    for fmt, code in (
        ({"type": "xml"}, "unsupported_parameter"),
        ({"type": "json_schema", "json_schema": {"name": "s"}}, "invalid_response_format"),
        ({"type": "json_schema"}, "invalid_response_format"),
    ):
        with pytest.raises(ApiError) as refused:
            response_format_sampling(request(response_format=fmt))
        assert refused.value.code == code and refused.value.field == "response_format"
    with pytest.raises(ApiError) as forced:
        response_format_sampling(request(response_format={"type": "json_object"}), prefill="<tool_call>")
    assert forced.value.field == "response_format"
    assert chat_logprobs(request(logprobs=True, top_logprobs=4)).top == 4
    assert chat_logprobs(request(top_logprobs=0)).top == 0  # 0 is neutral without logprobs
    with pytest.raises(ApiError) as alone:
        chat_logprobs(request(top_logprobs=2))
    assert alone.value.field == "top_logprobs" and alone.value.status == 400

    def completion(**fields: Any) -> CompletionRequest:
        return CompletionRequest.model_validate({"prompt": "hi", **fields})

    assert completion_logprobs(completion()) == completion_logprobs(completion(echo=True))
    assert not completion_logprobs(completion()).extra
    ask = completion_logprobs(completion(logprobs=2, echo=True))
    assert (ask.top, ask.prompt) == (2, True)
