"""SGLang's and vLLM's extensions of the OpenAI API on the rollout role, driven by the real ``openai``
package (``extra_body``) over a stack of real roles on loopback with the tiny model: ``return_token_ids``
(the prompt's ids are exactly ``/v1/rollouts``' ``prompt_ids``), each extra sampling field honoured
(it changes the answer as SGLang's sampler would) or refused by name, ``chat_template_kwargs``, and
``GET /v1/models/{id}``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from rollout.api import EXTENSION_REFUSALS
from rollout.prompts import PromptBuilder
from tests.services.conftest import RunningServer
from tests.services.rollout.test_e2e import IMAGE, Stack, data_uri

MODEL = "weir-tiny-omni"
# Qwen3's switch, added to the tiny model's template: with enable_thinking false the answer starts with an
# empty thought block.
THINKING = (
    "{%- if add_generation_prompt and enable_thinking is defined and enable_thinking is false -%}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}"
)
HI: list[Any] = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, RunningServer]]:
    stack = Stack(tmp_path_factory.mktemp("openai-extensions"))
    template = stack.model / "chat_template.jinja"
    template.write_text(template.read_text() + THINKING)  # read by the rollout role, which starts next
    yield stack, stack.rollout(max_n=4)
    stack.close()


@pytest.fixture()
def client(stack: tuple[Stack, RunningServer]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack[1].url}/v1", api_key="unused", max_retries=0)


def _ids(client: openai.OpenAI, messages: list[Any] = HI, **extra: Any) -> tuple[list[int], str, str]:
    """(completion ids, text, finish reason) of one greedy-by-default chat answer of up to 12 tokens."""
    request: dict[str, Any] = {"temperature": 0.0, "max_tokens": 12}
    body = {"return_token_ids": True, "ignore_eos": True}
    for name in ("temperature", "max_tokens", "seed", "logit_bias", "stop", "presence_penalty", "frequency_penalty"):
        if name in extra:
            request[name] = extra.pop(name)
    reply = client.chat.completions.create(model=MODEL, messages=messages, extra_body={**body, **extra}, **request)
    choice = reply.choices[0]
    return list(getattr(choice, "token_ids")), choice.message.content or "", choice.finish_reason  # noqa: B009


def test_return_token_ids_are_the_rollouts_prompt_and_response_ids(
    stack: tuple[Stack, RunningServer], client: openai.OpenAI
) -> None:
    _, rollout = stack
    messages: list[Any] = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_uri("image/png", IMAGE)}},
                {"type": "text", "text": "What shape is this?"},
            ],
        }
    ]
    body = {
        "prompts": [{"messages": messages}],
        "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True},
        "record": False,
    }
    answer = httpx.post(f"{rollout.url}/v1/rollouts", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    group = answer.json()["groups"][0]
    request: dict[str, Any] = {"model": MODEL, "messages": messages, "temperature": 0.0, "max_tokens": 8}
    extra = {"return_token_ids": True, "ignore_eos": True}
    reply = client.chat.completions.create(**request, extra_body=extra)
    assert getattr(reply, "prompt_token_ids") == group["prompt_ids"]  # noqa: B009 - an extension field
    assert reply.usage is not None and reply.usage.prompt_tokens == len(group["prompt_ids"])
    assert getattr(reply.choices[0], "token_ids") == group["samples"][0]["response_ids"]  # noqa: B009
    plain = client.chat.completions.create(**request, extra_body={"ignore_eos": True})
    assert "prompt_token_ids" not in (plain.model_extra or {})
    assert "token_ids" not in (plain.choices[0].model_extra or {})
    # Streamed, as vLLM: the prompt's ids on the choice's first chunk, each chunk its own tokens' ids.
    chunks = list(client.chat.completions.create(**request, extra_body=extra, stream=True))
    assert getattr(chunks[0], "prompt_token_ids") == group["prompt_ids"]  # noqa: B009
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all("prompt_token_ids" not in (c.model_extra or {}) for c in chunks[1:])
    streamed = [t for c in chunks for t in (c.choices[0].model_extra or {}).get("token_ids", [])]
    assert streamed == group["samples"][0]["response_ids"]
    assert sum(1 for c in chunks if (c.choices[0].model_extra or {}).get("token_ids")) >= 2  # not all at the end
    # n choices, interleaved: each choice's first chunk carries the prompt's ids, as vLLM's.
    several = list(client.chat.completions.create(**request, n=2, extra_body=extra, stream=True))
    firsts = {c.choices[0].index: c for c in reversed(several)}
    assert sorted(firsts) == [0, 1]
    assert all(getattr(c, "prompt_token_ids") == group["prompt_ids"] for c in firsts.values())  # noqa: B009
    assert sum(1 for c in several if "prompt_token_ids" in (c.model_extra or {})) == 2


def test_text_completions_return_token_ids(stack: tuple[Stack, RunningServer], client: openai.OpenAI) -> None:
    ids = PromptBuilder(stack[0].model).tokenizer.encode("what colour is the circle", add_special_tokens=False)
    common: dict[str, Any] = {"model": MODEL, "max_tokens": 6, "temperature": 0.0}
    extra = {"return_token_ids": True, "ignore_eos": True}
    whole = client.completions.create(prompt="what colour is the circle", extra_body=extra, **common)
    choice = whole.choices[0].model_extra or {}
    assert choice["prompt_token_ids"] == ids and len(choice["token_ids"]) == 6
    chunks = list(client.completions.create(prompt=ids, extra_body=extra, stream=True, **common))
    assert (chunks[0].choices[0].model_extra or {})["prompt_token_ids"] == ids
    streamed = [t for c in chunks for t in (c.choices[0].model_extra or {}).get("token_ids", [])]
    assert streamed == choice["token_ids"]


def test_top_k_1_and_min_p_1_are_greedy(client: openai.OpenAI) -> None:
    greedy, _, _ = _ids(client)
    assert _ids(client, temperature=1.0, seed=3, top_k=1)[0] == greedy
    assert _ids(client, temperature=1.0, seed=3, min_p=1.0)[0] == greedy
    assert _ids(client, temperature=1.0, seed=3, top_k=0)[0] == _ids(client, temperature=1.0, seed=3)[0]  # 0: all
    assert _ids(client, temperature=1.0, seed=3)[0] != greedy  # so the two above were not greedy by chance


def test_penalties_change_a_greedy_answer_that_repeats_itself(client: openai.OpenAI) -> None:
    greedy, _, _ = _ids(client, max_tokens=24)
    assert len(set(greedy)) < len(greedy)  # it repeats: each penalty has something to act on
    for field, value in (("repetition_penalty", 2.0), ("presence_penalty", 2.0), ("frequency_penalty", 2.0)):
        penalized, _, _ = _ids(client, max_tokens=24, **{field: value})
        assert penalized != greedy, field
        assert len(set(penalized)) >= len(set(greedy)), field


def test_stop_token_ids_min_tokens_and_special_tokens(
    stack: tuple[Stack, RunningServer], client: openai.OpenAI
) -> None:
    tokenizer = PromptBuilder(stack[0].model).tokenizer
    eos, start = (int(tokenizer.convert_tokens_to_ids(t)) for t in ("<|im_end|>", "<|im_start|>"))  # type: ignore[arg-type]
    greedy, _, _ = _ids(client)
    stop = greedy[3]
    stopped, _, finish = _ids(client, stop_token_ids=[stop])
    assert stopped == greedy[: greedy.index(stop) + 1] and finish == "stop"
    # EOS made certain by a bias: one token, unless min_tokens masks it.
    forced, _, _ = _ids(client, logit_bias={str(eos): 100}, ignore_eos=False)
    assert forced == [eos]
    held, _, _ = _ids(client, logit_bias={str(eos): 100}, ignore_eos=False, min_tokens=5)
    assert len(held) == 6 and eos not in held[:5] and held[5] == eos
    _, shown, _ = _ids(client, logit_bias={str(start): 100}, max_tokens=3, skip_special_tokens=False)
    _, hidden, _ = _ids(client, logit_bias={str(start): 100}, max_tokens=3)
    assert shown == "<|im_start|>" * 3 and hidden == ""


def test_no_stop_trim_and_regex(client: openai.OpenAI) -> None:
    _, text, _ = _ids(client, max_tokens=24)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    _, trimmed, _ = _ids(client, max_tokens=24, stop=[stop])
    _, kept, _ = _ids(client, max_tokens=24, stop=[stop], no_stop_trim=True)
    assert stop not in trimmed and kept == trimmed + stop
    _, answer, _ = _ids(client, temperature=1.0, seed=1, max_tokens=8, regex="(yes|no)", ignore_eos=False)
    assert answer in ("yes", "no")


def test_chat_template_kwargs_reach_the_template(client: openai.OpenAI) -> None:
    def prompt(**extra: Any) -> list[int]:
        reply = client.chat.completions.create(
            model=MODEL, messages=HI, max_tokens=1, extra_body={"return_token_ids": True, **extra}
        )
        return list(getattr(reply, "prompt_token_ids"))  # noqa: B009

    plain = prompt()
    thinking_off = prompt(chat_template_kwargs={"enable_thinking": False})
    assert thinking_off[: len(plain)] == plain and len(thinking_off) > len(plain)
    assert prompt(chat_template_kwargs={"enable_thinking": True}) == plain
    with pytest.raises(openai.BadRequestError) as reserved:
        client.chat.completions.create(
            model=MODEL,
            messages=HI,
            max_tokens=1,
            extra_body={"chat_template_kwargs": {"add_generation_prompt": False}},
        )
    assert reserved.value.code == "invalid_chat_template_kwargs" and reserved.value.param == "chat_template_kwargs"


@pytest.mark.parametrize(
    "field,value,code",
    [
        *[(name, True, "unsupported_parameter") for name in ("include_stop_str_in_output", "continue_final_message")],
        ("guided_json", {"type": "object"}, "unsupported_parameter"),
        ("chat_template", "{{ messages }}", "unsupported_parameter"),
        ("verbosity", "low", "unsupported_parameter"),
        ("top_kk", 1, "unknown_parameter"),
        ("sampling_params", {"top_k": 1}, "unknown_parameter"),
    ],
)
def test_fields_not_implemented_are_refused_by_name(client: openai.OpenAI, field: str, value: Any, code: str) -> None:
    assert field in EXTENSION_REFUSALS or code != "unsupported_parameter" or field == "verbosity"
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1, extra_body={field: value})
    assert refused.value.code == code and refused.value.param == field
    assert field in refused.value.message


def test_text_completions_refuse_chat_only_and_unknown_fields(client: openai.OpenAI) -> None:
    for field, value in (("chat_template_kwargs", {"enable_thinking": False}), ("best_of_n", 2)):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=1, extra_body={field: value})
        assert refused.value.code == "unknown_parameter" and refused.value.param == field


def test_a_bad_extension_value_is_an_error_naming_the_request_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as too_many:
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, extra_body={"min_tokens": 3})
    assert too_many.value.code == "bad_sampling_params" and too_many.value.param == "min_tokens"
    with pytest.raises(openai.BadRequestError) as two_grammars:
        client.chat.completions.create(
            model=MODEL, messages=HI, max_tokens=2, response_format={"type": "json_object"}, extra_body={"regex": "a"}
        )
    assert two_grammars.value.param == "regex"
    with pytest.raises(openai.UnprocessableEntityError) as schema:
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, extra_body={"top_k": -2})
    assert schema.value.param == "top_k"


def test_retrieve_a_model(client: openai.OpenAI) -> None:
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4o")
    assert missing.value.code == "model_not_found" and missing.value.type == "invalid_request_error"


def test_every_request_field_is_documented_as_honoured_ignored_or_refused() -> None:
    """The fields the schemas declare (and the extensions refused by name) are the documented surface:
    docs/api.md's OpenAI section names each one, so none is taken, or ignored, unannounced."""
    from pathlib import Path

    from rollout.api import ChatRequest, CompletionRequest

    docs = Path(__file__).resolve().parents[3] / "docs" / "api.md"
    section = docs.read_text().split("## The rollout role against OpenAI's API", 1)[1]
    names = {*ChatRequest.model_fields, *CompletionRequest.model_fields, *EXTENSION_REFUSALS}
    missing = sorted(name for name in names if f"`{name}`" not in section)
    assert not missing, missing
