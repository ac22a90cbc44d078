"""Chat-completion shaping, checked against the OpenAI SDK's own response types."""

from __future__ import annotations

from openai.types import Completion
from openai.types.chat import ChatCompletion

from experience.records import Sample, SampleStatus
from rollout import chat
from rollout.logprobs import ChoiceLogprobs


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


# -- top log-probs --------------------------------------------------------------------------------
DETAILS = [
    ChoiceLogprobs(top=[[(-0.4, 104), (-0.9, 120)], [(-0.8, 105), (-1.0, 106)]]),
    ChoiceLogprobs(top=[[(-0.5, 111), (-0.6, 112)], [(-1.0, 107), (-1.1, 108)], [(-1.5, 33), (-2.0, 34)]]),
]


def test_a_completion_with_top_logprobs() -> None:
    whole = chat.completion(
        SAMPLES, completion_id="c", created=0, model="m", prompt_tokens=2, token_text=token_text, details=DETAILS
    )
    parsed = ChatCompletion.model_validate(whole)
    content = parsed.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None
    assert [[(t.token, t.logprob, t.bytes) for t in e.top_logprobs] for e in content] == [
        [("h", -0.4, [104]), ("x", -0.9, [120])],
        [("i", -0.8, [105]), ("j", -1.0, [106])],
    ]


def test_a_streamed_choice_carries_its_tokens_alternatives() -> None:
    stream = chat.ChoiceStream({"id": "c"}, 0, token_text=token_text)
    out = stream.step([104], [-0.5], "h", None, [[(-0.4, 104), (-0.9, 120)]])
    entries = out[1]["choices"][0]["logprobs"]["content"]
    assert [(t["token"], t["logprob"]) for t in entries[0]["top_logprobs"]] == [("h", -0.4), ("x", -0.9)]
    [delta] = stream.step([105], [-1.0], "hi", None, [[(-0.8, 105)]])
    assert [t["token"] for t in delta["choices"][0]["logprobs"]["content"][0]["top_logprobs"]] == ["i"]


def test_legacy_top_logprobs_and_echo_with_the_prompts_logprobs() -> None:
    echo = ChoiceLogprobs(
        top=[[(-0.5, 111), (-0.6, 112)], [(-1.0, 107), (-1.1, 107)], [(-1.5, 33)]],
        prompt=[(None, 97), (-2.0, 98)],
        prompt_top=[None, [(-1.0, 99), (-2.0, 98)]],
    )
    whole = chat.text_completion(
        [SAMPLES[1]],
        completion_id="c",
        created=0,
        model="m",
        prompt_tokens=2,
        token_text=token_text,
        echo="ab",
        details=[echo],
        top=True,
    )
    # The SDK's types say float where OpenAI (and vLLM) answer null for an echoed prompt's first token.
    choice = whole["choices"][0]
    logprobs = choice["logprobs"]
    assert choice["text"] == "abok!" and logprobs["tokens"] == ["a", "b", "o", "k", "!"]
    assert logprobs["token_logprobs"] == [None, -2.0, -0.5, -1.0, -1.5]
    assert logprobs["text_offset"] == [0, 1, 2, 3, 4]
    # Two ids that decode alike: the likelier one's log-prob.
    assert logprobs["top_logprobs"] == [None, {"c": -1.0, "b": -2.0}, {"o": -0.5, "p": -0.6}, {"k": -1.0}, {"!": -1.5}]
    assert Completion.model_validate({**whole, "choices": [{**choice, "logprobs": None}]}).choices[0].text == "abok!"
    plain = chat.text_completion(
        [SAMPLES[1]], completion_id="c", created=0, model="m", prompt_tokens=2, token_text=token_text, details=[echo]
    )
    assert plain["choices"][0]["logprobs"]["top_logprobs"] is None  # logprobs: 0
    assert plain["choices"][0]["logprobs"]["tokens"] == ["o", "k", "!"]
    stream = chat.TextChoiceStream({"id": "c"}, 0, token_text=token_text, top=True, offset=2)
    [chunk] = stream.step([111, 107], [-0.5, -1.0], "ok", None, [[(-0.5, 111)], [(-1.0, 107)]])
    assert chunk["choices"][0]["logprobs"]["text_offset"] == [2, 3]
    assert chunk["choices"][0]["logprobs"]["top_logprobs"] == [{"o": -0.5}, {"k": -1.0}]
