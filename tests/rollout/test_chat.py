"""Chat-completion shaping, checked against the OpenAI SDK's own response types."""

from __future__ import annotations

import json

from openai.types.chat import ChatCompletion, ChatCompletionChunk

from experience.records import Sample, SampleStatus
from rollout import chat


def _sample(index: int, ids: list[int], finish: str, text: str) -> Sample:
    logprobs = [-0.5 * (i + 1) for i in range(len(ids))]
    return Sample(
        index=index,
        status=SampleStatus.OK,
        response_ids=ids,
        logprobs=logprobs,
        text=text,
        finish_reason=finish,  # type: ignore[arg-type]
        policy_version=0,
    )


SAMPLES = [_sample(0, [104, 105], "stop", "hi"), _sample(1, [111, 107, 33], "length", "ok!")]


def token_text(token: int) -> str:
    return chr(token)


def test_a_completion_is_an_openai_chat_completion() -> None:
    whole = chat.completion(
        SAMPLES, completion_id="chatcmpl-x", created=7, model="m", prompt_tokens=10, token_text=token_text
    )
    parsed = ChatCompletion.model_validate(whole)
    assert [c.message.content for c in parsed.choices] == ["hi", "ok!"]
    assert [c.finish_reason for c in parsed.choices] == ["stop", "length"]
    assert parsed.usage is not None
    assert (parsed.usage.prompt_tokens, parsed.usage.completion_tokens, parsed.usage.total_tokens) == (10, 5, 15)
    content = parsed.choices[1].logprobs.content  # type: ignore[union-attr]
    assert [(c.token, c.logprob, c.bytes) for c in content or []] == [
        ("o", -0.5, [111]),
        ("k", -1.0, [107]),
        ("!", -1.5, [33]),
    ]


def test_without_logprobs_there_are_none() -> None:
    whole = chat.completion(SAMPLES, completion_id="c", created=0, model="m", prompt_tokens=1)
    assert all(choice["logprobs"] is None for choice in whole["choices"])


def test_an_aborted_sample_finishes_as_stop() -> None:
    aborted = Sample(index=0, status=SampleStatus.ABORTED, finish_reason="abort", policy_version=0)
    assert chat.finish_reason(aborted) == "stop"


def test_stream_chunks_are_openai_chunks_and_add_up_to_the_completion() -> None:
    whole = chat.completion(SAMPLES, completion_id="c", created=0, model="m", prompt_tokens=4, token_text=token_text)
    chunks = chat.stream_chunks(whole, include_usage=True)
    parsed = [ChatCompletionChunk.model_validate(c) for c in chunks]
    for choice in whole["choices"]:
        deltas = [c.choices[0] for c in parsed if c.choices and c.choices[0].index == choice["index"]]
        assert "".join(d.delta.content or "" for d in deltas) == choice["message"]["content"]
        assert deltas[0].delta.role == "assistant" and deltas[-1].finish_reason == choice["finish_reason"]
    assert parsed[-1].choices == [] and parsed[-1].usage is not None and parsed[-1].usage.total_tokens == 9
    assert all(c.usage is None for c in parsed[:-1])


def test_sse_events_end_with_done() -> None:
    events = list(chat.sse_events([{"a": 1}, {"b": 2}]))
    assert events[-1] == b"data: [DONE]\n\n"
    assert [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]] == [{"a": 1}, {"b": 2}]
