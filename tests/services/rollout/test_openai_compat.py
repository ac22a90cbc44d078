"""The rollout role as the OpenAI chat API, driven by the real ``openai`` package over a stack of real
roles on loopback: per-choice seeds, true token streaming, tool calling, top log-probs (chat and
completions, echo with the prompt's log-probs), JSON mode, OpenAI's errors; and per-sample seeds in
``POST /v1/rollouts``."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from engines.sampling import SUPPORTED_SAMPLING
from tests.services.conftest import RunningServer
from tests.services.rollout.test_e2e import Stack

MODEL = "weir-tiny-omni"
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "the weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, RunningServer]]:
    stack = Stack(tmp_path_factory.mktemp("openai"))
    yield stack, stack.rollout()
    stack.close()


@pytest.fixture()
def client(stack: tuple[Stack, RunningServer]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack[1].url}/v1", api_key="unused", max_retries=0)


def test_a_seeded_rollout_group_is_reproducible_and_not_identical(stack: tuple[Stack, RunningServer]) -> None:
    _, rollout = stack
    body = {
        "prompts": [{"messages": [{"role": "user", "content": "hi"}], "n": 4}],
        "sampling_params": {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 42, "ignore_eos": True},
        "record": False,
    }

    def responses() -> list[list[int]]:
        answer = httpx.post(f"{rollout.url}/v1/rollouts", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        return [s["response_ids"] for s in answer.json()["groups"][0]["samples"]]

    first = responses()
    assert len({tuple(r) for r in first}) > 1  # not four copies of one sample: advantages are not all zero
    assert responses() == first  # the same seed again: the same samples


def test_chat_choices_with_a_seed_are_distinct_and_reproducible(client: openai.OpenAI) -> None:
    def contents() -> list[str | None]:
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            n=4,
            seed=7,
            temperature=1.0,
            max_tokens=8,
            extra_body={"ignore_eos": True},
        )
        return [c.message.content for c in sorted(reply.choices, key=lambda c: c.index)]

    first = contents()
    assert len(set(first)) > 1
    assert contents() == first


def test_streaming_sends_each_token_as_it_is_generated(client: openai.OpenAI) -> None:
    request: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "count to ten"}],
        "n": 2,
        "seed": 3,
        "temperature": 1.0,
        "max_tokens": 32,
        "logprobs": True,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.chat.completions.create(**request)
    chunks = list(client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices
    assert whole.usage is not None and usage.completion_tokens == whole.usage.completion_tokens == 64
    by_choice: dict[int, list[Any]] = {0: [], 1: []}
    order = []
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        by_choice[choice.index].append(choice)
        order.append(choice.index)
    assert order != sorted(order)  # the choices are interleaved, as their engines produce them
    for index, choices in by_choice.items():
        expected = whole.choices[index]
        content = [c for c in choices if c.delta.content]
        text = "".join(c.delta.content or "" for c in choices)
        assert text == expected.message.content  # the same seed: the same answer, streamed or not
        # Measured in tokens: the first content chunk carries fewer than all 32 tokens' log-probs, so it
        # was sent before the last token was generated.
        assert len(content) >= 2
        first = content[0]
        assert first.logprobs is not None and first.logprobs.content is not None
        assert 1 <= len(first.logprobs.content) < 32
        assert text.startswith(first.delta.content or "") and len(first.delta.content or "") < len(text)
        streamed_logprobs = [e.logprob for c in choices if c.logprobs for e in c.logprobs.content or []]
        assert expected.logprobs is not None and expected.logprobs.content is not None
        assert streamed_logprobs == pytest.approx([e.logprob for e in expected.logprobs.content])
        assert [c.finish_reason for c in choices][:-1] == [None] * (len(choices) - 1)
        assert choices[-1].finish_reason == "length" and choices[0].delta.role == "assistant"


def test_a_two_turn_tool_call_conversation(stack: tuple[Stack, RunningServer], client: openai.OpenAI) -> None:
    history: list[Any] = [
        {"role": "developer", "content": "answer briefly"},
        {"role": "user", "content": "what is the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_0", "content": "sunny, 21 C"},
    ]
    reply = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, tool_choice="auto", max_tokens=4, seed=1
    )
    [choice] = reply.choices
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content is not None or choice.message.tool_calls
    # The prompt is the template's rendering with the tools: its token count is the usage's.
    stack_, _ = stack
    from rollout.prompts import PromptBuilder, parse_messages

    builder = PromptBuilder(stack_.model)
    template, _ = parse_messages(history)
    ids = builder.build(template, [], tools=TOOLS)
    assert reply.usage is not None and reply.usage.prompt_tokens == len(ids)
    assert "<tools>" in builder.render(template, tools=TOOLS)
    # tool_choice none: the tools are not in the prompt.
    plain = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=2)
    assert plain.usage is not None and plain.usage.prompt_tokens == len(builder.build(template, []))
    # A named function starts the answer with a call to it; required with a call to one of the tools.
    named = client.chat.completions.create(
        model=MODEL,
        messages=history,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=2,
    )
    forced = builder.build(template, [], tools=TOOLS, prefill='<tool_call>\n{"name": "get_weather", "arguments": ')
    assert named.usage is not None and named.usage.prompt_tokens == len(forced)
    streamed = list(
        client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=3, seed=1, stream=True)
    )
    assert streamed[-1].choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_openai_errors(client: openai.OpenAI) -> None:
    hi: list[Any] = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o", messages=hi, max_tokens=2)
    assert missing.value.code == "model_not_found" and missing.value.type == "invalid_request_error"
    assert missing.value.param == "model"
    for response_format, code in (
        ({"type": "xml"}, "unsupported_parameter"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "invalid_response_format"),  # no schema
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=MODEL, messages=hi, max_tokens=2, response_format=response_format)  # type: ignore[arg-type]
        assert refused.value.param == "response_format" and refused.value.code == code
    with pytest.raises(openai.BadRequestError) as forced_call:
        client.chat.completions.create(
            model=MODEL,
            messages=hi,
            tools=TOOLS,
            tool_choice="required",
            response_format={"type": "json_object"},
            max_tokens=2,
        )
    assert forced_call.value.param == "response_format"
    with pytest.raises(openai.BadRequestError) as no_logprobs:
        client.chat.completions.create(model=MODEL, messages=hi, max_tokens=2, top_logprobs=3)
    assert no_logprobs.value.param == "top_logprobs"
    with pytest.raises(openai.UnprocessableEntityError):  # OpenAI's range: 0 to 20
        client.chat.completions.create(model=MODEL, messages=hi, max_tokens=2, logprobs=True, top_logprobs=21)
    with pytest.raises(openai.BadRequestError) as unknown_tool:
        client.chat.completions.create(
            model=MODEL,
            messages=hi,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}},
            max_tokens=2,
        )
    assert unknown_tool.value.param == "tool_choice"
    with pytest.raises(openai.BadRequestError) as no_tools:
        client.chat.completions.create(model=MODEL, messages=hi, tool_choice="required", max_tokens=2)
    assert no_tools.value.param == "tool_choice"
    with pytest.raises(openai.UnprocessableEntityError) as schema:
        client.chat.completions.create(model=MODEL, messages=hi, max_tokens=0)
    assert schema.value.param == "max_tokens" and schema.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(model=MODEL, messages=hi, max_tokens=40_000)
    assert too_long.value.code == "max_tokens_beyond_context"
    assert client.chat.completions.create(model=MODEL, messages=hi, max_tokens=2, response_format={"type": "text"})


def test_penalties_and_logit_bias_reach_the_engines_or_are_refused_by_name(client: openai.OpenAI) -> None:
    hi: list[Any] = [{"role": "user", "content": "hi"}]
    fields: dict[str, Any] = {"frequency_penalty": 0.5, "presence_penalty": -1.0, "logit_bias": {"5": 10}}
    for name, value in fields.items():
        if name in SUPPORTED_SAMPLING:
            reply = client.chat.completions.create(model=MODEL, messages=hi, max_tokens=2, **{name: value})
            assert reply.choices[0].finish_reason in ("stop", "length")
        else:
            with pytest.raises(openai.BadRequestError) as refused:
                client.chat.completions.create(model=MODEL, messages=hi, max_tokens=2, **{name: value})
            assert refused.value.param == name


def test_a_stream_stops_at_a_stop_string_without_sending_it(client: openai.OpenAI, tmp_path: Path) -> None:
    request: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "seed": 5,
        "temperature": 1.0,
        "max_tokens": 24,
        "extra_body": {"ignore_eos": True},
    }
    free = client.chat.completions.create(**request).choices[0].message.content or ""
    assert len(free) > 4
    stop = free[len(free) // 2 : len(free) // 2 + 2]
    whole = client.chat.completions.create(**request, stop=[stop]).choices[0].message.content or ""
    streamed = "".join(
        c.choices[0].delta.content or "" for c in client.chat.completions.create(**request, stop=[stop], stream=True)
    )
    assert streamed == whole and stop not in streamed


def test_text_completions(stack: tuple[Stack, RunningServer], client: openai.OpenAI) -> None:
    stack_, _ = stack
    from rollout.prompts import PromptBuilder

    tokenizer = PromptBuilder(stack_.model).tokenizer
    ids = tokenizer.encode("what colour is the circle", add_special_tokens=False)
    common: dict[str, Any] = {"model": MODEL, "max_tokens": 6, "temperature": 1.0, "extra_body": {"ignore_eos": True}}
    by_text = client.completions.create(prompt="what colour is the circle", seed=9, n=3, logprobs=0, **common)
    by_ids = client.completions.create(prompt=ids, seed=9, n=3, logprobs=0, **common)
    assert by_text.object == "text_completion" and [c.index for c in by_text.choices] == [0, 1, 2]
    assert [c.text for c in by_text.choices] == [c.text for c in by_ids.choices]  # the same prompt, the same seed
    assert len({c.text for c in by_text.choices}) > 1  # each choice its own seed
    assert by_text.usage is not None and by_text.usage.prompt_tokens == len(ids)
    assert by_text.usage.completion_tokens == 18
    for choice in by_text.choices:
        assert choice.logprobs is not None and len(choice.logprobs.token_logprobs or []) == 6
        assert choice.logprobs.text_offset is not None and choice.logprobs.text_offset[0] == 0
    echoed = client.completions.create(prompt=ids, seed=9, echo=True, **common)
    assert echoed.choices[0].text == "what colour is the circle" + by_text.choices[0].text
    batch = client.completions.create(prompt=["red", "blue"], n=2, seed=1, **common)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    streamed = list(client.completions.create(prompt=ids, seed=9, stream=True, logprobs=0, **common))
    pieces = [c.choices[0].text for c in streamed if c.choices and c.choices[0].text]
    assert len(pieces) >= 2 and "".join(pieces) == by_text.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "length"
    streamed_echo = list(client.completions.create(prompt=ids, seed=9, stream=True, echo=True, **common))
    texts = [c.choices[0].text for c in streamed_echo if c.choices and c.choices[0].text]
    assert texts[0] == "what colour is the circle" and "".join(texts) == echoed.choices[0].text
    for field, value in (("suffix", "x"), ("best_of", 3)):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(prompt="hi", **{**common, field: value})
        assert refused.value.param == field
    with pytest.raises(openai.BadRequestError):
        client.completions.create(prompt=[10**6], **common)  # not a token id of this model
    with pytest.raises(openai.NotFoundError):
        client.completions.create(prompt="hi", **{**common, "model": "davinci-002"})


def test_only_the_openai_routes_answer_in_openais_error_shape(stack: tuple[Stack, RunningServer]) -> None:
    _, rollout = stack
    chat = httpx.post(f"{rollout.url}/v1/chat/completions", json={"messages": "no"}, timeout=30)
    error = chat.json()["error"]
    assert chat.status_code == 422 and set(error) >= {"message", "type", "param", "code"}
    assert error["param"] == "messages" and error["type"] == "invalid_request_error"
    assert int(chat.headers["content-length"]) == len(chat.content)
    weir = httpx.post(f"{rollout.url}/v1/rollouts", json={"prompts": "no"}, timeout=30).json()["error"]
    assert "type" not in weir and weir["field"] == "prompts"  # Weir's own routes keep Weir's shape


def test_openai_error_types_follow_the_status() -> None:
    from services.rollout.openai_errors import openai_error

    base = {"code": "c", "message": "m"}
    assert openai_error(base, 401)["type"] == "authentication_error"
    assert openai_error(base, 429)["type"] == "rate_limit_error"
    assert openai_error(base, 503)["type"] == "server_error"
    assert openai_error({**base, "field": "n"}, 400) == {
        "code": "c",
        "message": "m",
        "field": "n",
        "type": "invalid_request_error",
        "param": "n",
    }


def test_a_client_that_leaves_a_stream_frees_its_engines(stack: tuple[Stack, RunningServer]) -> None:
    _, rollout = stack
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "n": 2,
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{rollout.url}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert any(line.startswith("data: {") and '"content": "' in line and '""' not in line for line in lines)
    dispatcher = rollout.app.state.weir.dispatcher
    deadline = time.monotonic() + 10
    while any(e.outstanding for e in dispatcher.engines) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [e.outstanding for e in dispatcher.engines] == [0]


def _check_top(entries: list[Any], k: int) -> None:
    """Each chat log-prob entry has ``k`` alternatives, most likely first; where the sampled token is
    one of them, its log-prob is that alternative's."""
    assert entries
    for entry in entries:
        tops = entry.top_logprobs
        assert len(tops) == k
        values = [t.logprob for t in tops]
        assert values == sorted(values, reverse=True)
        assert all(t.bytes == list(t.token.encode()) for t in tops)
        if "\ufffd" in entry.token:  # part of a character: other ids decode alike
            continue
        same = [t.logprob for t in tops if t.token == entry.token]
        if same:
            assert any(abs(entry.logprob - v) < 1e-4 for v in same)
        else:  # not among the k most likely: no likelier than the last of them
            assert entry.logprob <= values[-1] + 1e-4


def test_streamed_chat_with_top_logprobs(client: openai.OpenAI) -> None:
    request: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "count to ten"}],
        "n": 2,
        "seed": 11,
        "temperature": 1.0,
        "max_tokens": 12,
        "logprobs": True,
        "top_logprobs": 3,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.chat.completions.create(**request)
    chunks = list(client.chat.completions.create(**request, stream=True))
    for index in (0, 1):
        choices = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        streamed = [e for c in choices if c.logprobs for e in c.logprobs.content or []]
        assert len(streamed) == 12
        _check_top(streamed, 3)
        expected = whole.choices[index].logprobs
        assert expected is not None and expected.content is not None
        assert [t.logprob for e in streamed for t in e.top_logprobs] == pytest.approx(
            [t.logprob for e in expected.content for t in e.top_logprobs]
        )
        assert "".join(c.delta.content or "" for c in choices) == whole.choices[index].message.content
    # Greedy: the sampled token is always the most likely one.
    greedy = list(client.chat.completions.create(**{**request, "n": 1, "temperature": 0.0}, stream=True))
    entries = [e for c in greedy if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
    _check_top(entries, 3)
    assert [e.logprob for e in entries] == pytest.approx([e.top_logprobs[0].logprob for e in entries], abs=1e-4)


def test_streamed_top_logprobs_come_token_by_token(client: openai.OpenAI) -> None:
    # The engine role's stream carries the top log-probs so far in every chunk (as SGLang's), so a
    # streamed choice with top_logprobs is sent as it is generated, not in one delta at its end.
    request: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "count to ten"}],
        "seed": 5,
        "temperature": 1.0,
        "max_tokens": 8,
        "logprobs": True,
        "top_logprobs": 2,
        "extra_body": {"ignore_eos": True},
    }
    chunks = list(client.chat.completions.create(**request, stream=True))
    with_logprobs = [c.choices[0] for c in chunks if c.choices and c.choices[0].logprobs]
    counts = [len(c.logprobs.content or []) for c in with_logprobs]  # type: ignore[union-attr]
    assert len(with_logprobs) > 1 and sum(counts) == 8
    assert counts[0] < 8  # the first content chunk came before the last token was generated
    entries = [e for c in with_logprobs for e in c.logprobs.content or []]  # type: ignore[union-attr]
    _check_top(entries, 2)
    # A streamed completion with echo: the prompt's log-probs first, then the answer's tokens as they come.
    completion: dict[str, Any] = {
        "model": MODEL,
        "prompt": "what colour is the circle",
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": 5,
        "logprobs": 2,
        "echo": True,
        "extra_body": {"ignore_eos": True},
    }
    streamed = [c.choices[0] for c in client.completions.create(**completion, stream=True) if c.choices]
    answer_counts = [len(c.logprobs.tokens or []) for c in streamed[1:] if c.logprobs]
    assert streamed[0].text == completion["prompt"] and sum(answer_counts) == 8
    assert len(answer_counts) > 1 and answer_counts[0] < 8


def test_chat_top_logprobs(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        n=2,
        seed=5,
        max_tokens=6,
        logprobs=True,
        top_logprobs=5,
        extra_body={"ignore_eos": True},
    )
    for choice in reply.choices:
        assert choice.logprobs is not None and choice.logprobs.content is not None
        assert len(choice.logprobs.content) == 6
        _check_top(choice.logprobs.content, 5)
    plain = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, logprobs=True, top_logprobs=0
    )
    assert plain.choices[0].logprobs is not None and plain.choices[0].logprobs.content is not None
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)


def test_completions_with_top_logprobs_and_echo(client: openai.OpenAI) -> None:
    prompt = "what colour is the circle"
    common: dict[str, Any] = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 5,
        "temperature": 1.0,
        "seed": 3,
        "logprobs": 2,
        "extra_body": {"ignore_eos": True},
    }
    plain = client.completions.create(**common)
    [choice] = plain.choices
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.tokens is not None and logprobs.top_logprobs is not None
    assert len(logprobs.tokens) == len(logprobs.top_logprobs) == 5 and logprobs.text_offset is not None
    assert logprobs.text_offset[0] == 0
    for top in logprobs.top_logprobs:
        assert 1 <= len(top) <= 2 and list(top.values()) == sorted(top.values(), reverse=True)
    assert plain.usage is not None
    echoed = client.completions.create(**common, echo=True)
    [echo] = echoed.choices
    assert echo.text == prompt + choice.text  # the same seed: the same answer
    logprobs = echo.logprobs
    assert logprobs is not None and logprobs.tokens is not None and logprobs.token_logprobs is not None
    assert logprobs.top_logprobs is not None and logprobs.text_offset is not None
    assert "".join(logprobs.tokens) == prompt + choice.text
    assert len(logprobs.tokens) == plain.usage.prompt_tokens + 5
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(isinstance(v, float) for v in logprobs.token_logprobs[1:])
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset[-5] == len(prompt)
    assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs[1:])
    assert logprobs.token_logprobs[-5:] == pytest.approx(choice.logprobs.token_logprobs)  # type: ignore[union-attr]
    streamed = [c.choices[0] for c in client.completions.create(**common, echo=True, stream=True) if c.choices]
    assert streamed[0].text == prompt and streamed[0].logprobs is not None
    assert streamed[0].logprobs.token_logprobs is not None and streamed[0].logprobs.token_logprobs[0] is None
    tokens = [t for c in streamed if c.logprobs for t in c.logprobs.tokens or []]
    assert "".join(tokens) == "".join(c.text for c in streamed) == echo.text
    offsets = [o for c in streamed if c.logprobs for o in c.logprobs.text_offset or []]
    assert offsets == logprobs.text_offset


def test_json_mode(client: openai.OpenAI) -> None:
    """response_format json_object and json_schema: the engines' constrained decoding (SGLang's
    ``json_schema`` sampling key) makes every choice parse."""
    hi: list[Any] = [{"role": "user", "content": "describe a circle as JSON"}]
    # Room for the tiny random model to close its JSON (seeded: the same answers each run).
    common: dict[str, Any] = {"model": MODEL, "messages": hi, "n": 2, "seed": 7, "max_tokens": 1024}
    reply = client.chat.completions.create(**common, response_format={"type": "json_object"})
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        json.loads(choice.message.content or "")  # any JSON value, as SGLang's json_object ("$$ANY$$")
    schema = {
        "type": "object",
        "properties": {"round": {"type": "boolean"}, "sides": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["round", "sides"],
        "additionalProperties": False,
    }
    shaped = client.chat.completions.create(
        **common,
        response_format={"type": "json_schema", "json_schema": {"name": "shape", "schema": schema, "strict": True}},
    )
    for choice in shaped.choices:
        answer = json.loads(choice.message.content or "")
        assert set(answer) == {"round", "sides"} and isinstance(answer["round"], bool)
        assert isinstance(answer["sides"], int) and 0 <= answer["sides"] <= 9
