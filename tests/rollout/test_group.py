"""The rollout's pieces that need no other role: engine answers → samples, engine bodies, rewards
as data, the rollout-function contract."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from encoders.client import AsyncEncoderClient
from engines.api import MediaRef
from engines.protocol import SamplingParams
from experience import wire
from experience.records import Group, SampleStatus
from preprocess.api import MediaItem
from preprocess.client import AsyncPreprocessClient
from rollout.admission import Admission
from rollout.context import PromptSpec, RolloutContext
from rollout.dispatch import Dispatcher, EngineEndpoint
from rollout.errors import MediaRefused, UpstreamUnauthorized, UpstreamUnavailable
from rollout.generation import engine_body, sample_from_engine
from rollout.group import run_prompt
from rollout.preparation import Prepared, prepare
from rollout.prompts import PromptBuilder
from rollout.rewards import RewardRegistry, RewardSpec
from rollout.scoring import reward_samples
from rollout.sink import JsonlSink
from tests.ports import free_port
from tests.services.conftest import RunningServer


def answer(**meta: Any) -> dict[str, Any]:
    base = {
        "finish_reason": {"type": "length", "length": 2},
        "weight_version": "3",
        "output_token_logprobs": [[-0.5, 5, None], [-0.25, 6, None]],
    }
    return {"text": "ok", "output_ids": [5, 6], "meta_info": {**base, **meta}}


def test_an_engine_answer_is_a_typed_sample() -> None:
    sample = sample_from_engine(answer(), index=3, generate_s=0.1)
    assert sample.status is SampleStatus.OK and sample.index == 3
    assert sample.policy_version == 3 and sample.finish_reason == "length"
    assert sample.response_ids == [5, 6] and sample.logprobs == [-0.5, -0.25] and sample.text == "ok"
    assert sample_from_engine(answer(weight_version="default"), index=0, generate_s=0).policy_version == 0


def test_an_aborted_answer_is_an_aborted_sample() -> None:
    sample = sample_from_engine(answer(finish_reason={"type": "abort"}), index=0, generate_s=0)
    assert sample.status is SampleStatus.ABORTED and sample.finish_reason == "abort"


@pytest.mark.parametrize(
    "meta,problem",
    [
        ({"weight_version": "v2-final"}, "not a policy version"),
        ({"weight_version": None}, "not a policy version"),
        ({"finish_reason": {"type": "tool_calls"}}, "finish_reason 'tool_calls'"),
        ({"finish_reason": None}, "finish_reason None"),
        ({"output_token_logprobs": [[-0.5, 5, None]]}, "1 log-probs for 2 tokens"),
        ({"output_token_logprobs": [["x", 5, None], [-0.1, 6, None]]}, "malformed engine response"),
    ],
)
def test_an_unreadable_answer_is_a_failed_sample_never_a_guess(meta: dict[str, Any], problem: str) -> None:
    sample = sample_from_engine(answer(**meta), index=1, generate_s=0)
    assert sample.status is SampleStatus.FAILED and problem in (sample.error or "")
    assert sample.policy_version is None


@pytest.mark.parametrize(
    "change,problem",
    [
        ({"output_token_logprobs": [[-math.inf, 5, None], [-0.25, 6, None]]}, "logprobs.0"),
        ({"output_token_logprobs": [[math.nan, 5, None], [-0.25, 6, None]]}, "logprobs.0"),
        ({"output_token_logprobs": [[-0.5, 5, None], [math.inf, 6, None]]}, "logprobs.1"),
        ({"output_ids": [5, -6]}, "response_ids.1"),
        ({"output_ids": [5, -6], "weight_version": "v2"}, "not a policy version"),
    ],
)
def test_an_answer_the_record_refuses_is_a_failed_sample_not_an_error(change: dict[str, Any], problem: str) -> None:
    """A -inf/NaN log-prob or a negative token id breaks the `Sample` record (finite floats, ids >= 0):
    the sample fails saying which value, the request goes on (no ValidationError, no 500)."""
    out = answer(**{k: v for k, v in change.items() if k != "output_ids"})
    if "output_ids" in change:
        out["output_ids"] = change["output_ids"]
    sample = sample_from_engine(out, index=2, generate_s=0.5)
    assert sample.status is SampleStatus.FAILED and sample.index == 2
    assert problem in (sample.error or "") and "not a valid sample" in (sample.error or ""), sample.error
    assert sample.response_ids == [] and sample.logprobs == [] and sample.policy_version is None
    assert sample.text == "ok" and sample.timings == {"generate_s": 0.5}
    group = Group(group_id="g", prompt_ids=[1], samples=[sample])  # the failed record itself validates
    assert Group.from_json(json.loads(json.dumps(group.to_json()))) == group


def packed(out: dict[str, Any]) -> dict[str, Any]:
    """``out`` as Weir's engine answers it when asked for ``weir_packed``."""
    meta = {k: v for k, v in out["meta_info"].items() if k != "output_token_logprobs"}
    logprobs = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    arrays = {"output_ids": wire.pack(out["output_ids"], "<i4"), "output_logprobs": wire.pack(logprobs, "<f8")}
    return {"text": out["text"], "meta_info": meta, "weir_packed": arrays}


def test_a_packed_answer_is_the_same_sample_as_its_json_lists() -> None:
    for meta in ({}, {"finish_reason": {"type": "abort"}}, {"weight_version": "v2"}):
        assert sample_from_engine(packed(answer(**meta)), index=3, generate_s=0.1) == sample_from_engine(
            answer(**meta), index=3, generate_s=0.1
        )
    inf = answer(output_token_logprobs=[[-math.inf, 5, None], [-0.25, 6, None]])
    assert "logprobs.0" in (sample_from_engine(packed(inf), index=0, generate_s=0).error or "")


@pytest.mark.parametrize(
    "arrays,problem",
    [
        ({"output_ids": "not base64!", "output_logprobs": ""}, "not base64"),
        ({"output_ids": "BQAAAAYAAAA=", "output_logprobs": "AAAA"}, "whole number"),  # 3 bytes of float64
        ({"output_ids": 5}, "base64 string"),
        ({"output_ids": "BQAAAAYAAAA="}, "0 log-probs for 2 tokens"),
        ({"output_logprobs": "AAAAAAAA4L8="}, "malformed engine response"),
    ],
)
def test_a_malformed_packed_answer_is_a_failed_sample(arrays: dict[str, Any], problem: str) -> None:
    out = packed(answer())
    out["weir_packed"] = arrays
    sample = sample_from_engine(out, index=0, generate_s=0)
    assert sample.status is SampleStatus.FAILED and problem in (sample.error or ""), sample.error


def test_a_missing_meta_info_is_a_failed_sample() -> None:
    sample = sample_from_engine({"text": "x"}, index=0, generate_s=0)
    assert sample.status is SampleStatus.FAILED and "malformed engine response" in (sample.error or "")


PREPARED = Prepared(
    prompt_ids=[1, 2, 9, 9, 3],
    media=[MediaRef(type="image", embedding_key="e" * 40)],
    inline=[MediaItem(type="image", data="data:image/png;base64,AA"), MediaItem(type="audio", path="/m/a.wav")],
    feature_keys=["f" * 40],
    token_counts={"text": 3, "image": 2},
    preprocess_s=0.0,
)


def test_engine_bodies() -> None:
    sampling = SamplingParams(max_new_tokens=4)
    weir = engine_body(EngineEndpoint.parse("http://e:1/"), PREPARED, sampling, "g/0", routed_experts=False)
    assert weir.weir_media == PREPARED.media and weir.rid == "g/0" and weir.input_ids == [1, 2, 9, 9, 3]
    plain = engine_body(EngineEndpoint.parse("sglang+http://e:1"), PREPARED, sampling, "g/0", routed_experts=True)
    assert weir.weir_packed is True  # ids and log-probs packed: only Weir's engine, only without top log-probs
    sent = plain.model_fields_set
    assert "weir_media" not in sent and "weir_packed" not in sent and plain.return_routed_experts is True
    assert plain.image_data == ["data:image/png;base64,AA"] and plain.audio_data == ["file:///m/a.wav"]
    assert PREPARED.media_tokens == 2


def flaky(response: str, reference: str | None, sample: Mapping[str, Any]) -> float:
    if sample["sample_index"] == 1:
        raise RuntimeError("fails on purpose")
    return math.nan if sample["sample_index"] == 2 else 0.5


@pytest.fixture()
def context(model: Path, tmp_path: Path) -> Iterator[RolloutContext]:
    """A real context whose roles are never called by these tests (nothing listens on port 9)."""
    client = httpx.AsyncClient(base_url="http://127.0.0.1:9")
    yield RolloutContext(
        prompts=PromptBuilder(model),
        dispatcher=Dispatcher(["http://127.0.0.1:9"], timeout_s=1, client=client),
        preprocess=AsyncPreprocessClient("http://127.0.0.1:9", http=client),
        encoder=None,
        sink=JsonlSink(tmp_path / "experience.jsonl"),
        rewards=RewardRegistry({"flaky": flaky}),
        admission=Admission(max_media_tokens=10, max_bytes=10),
    )


def test_rewards_are_data_a_failing_one_fails_only_its_sample(context: RolloutContext) -> None:
    samples = [sample_from_engine(answer(), index=i, generate_s=0) for i in range(3)]
    failed_engine = sample_from_engine({}, index=3, generate_s=0)
    spec = RewardSpec(type="custom", function="flaky")
    out = asyncio.run(reward_samples(context, spec, [*samples, failed_engine], group_id="g", prompt_index=0))
    assert [s.status for s in out] == [SampleStatus.OK, SampleStatus.FAILED, SampleStatus.FAILED, SampleStatus.FAILED]
    assert out[0].reward == 0.5 and out[0].trainable
    assert "RuntimeError: fails on purpose" in (out[1].error or "") and out[1].response_ids == [5, 6]
    assert "not a finite number" in (out[2].error or "") and out[2].reward is None
    assert out[3] is failed_engine  # never rewarded


def _group(prompt: PromptSpec, index: int) -> Group:
    sample = sample_from_engine(answer(), index=0, generate_s=0)
    return Group(group_id=prompt.group_id or "g0", prompt_ids=[1], samples=[sample], prompt_index=index)


async def fixed(
    ctx: RolloutContext, prompt: PromptSpec, /, *, index: int, sampling: dict[str, Any], budget: Any
) -> Group:
    return _group(prompt, index)


async def not_a_group(ctx: RolloutContext, prompt: PromptSpec, /, *, index: int, sampling: Any, budget: Any) -> Any:
    return _group(prompt, index).to_json()


def test_run_prompt_records_only_when_asked(context: RolloutContext, tmp_path: Path) -> None:
    prompt = PromptSpec(messages=[{"role": "user", "content": "hi"}], group_id="g1")
    group = asyncio.run(
        run_prompt(context, fixed, prompt, index=2, sampling=SamplingParams(), budget=None, record=False)
    )
    assert group.prompt_index == 2 and not (tmp_path / "experience.jsonl").exists()
    asyncio.run(run_prompt(context, fixed, prompt, index=2, sampling=SamplingParams(), budget=None, record=True))
    lines = (tmp_path / "experience.jsonl").read_text().splitlines()
    assert [Group.from_json(json.loads(line)) for line in lines] == [group]


def test_a_rollout_function_must_return_a_group(context: RolloutContext) -> None:
    prompt = PromptSpec(messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(TypeError, match="not a Group"):
        asyncio.run(
            run_prompt(context, not_a_group, prompt, index=0, sampling=SamplingParams(), budget=None, record=True)
        )


IMAGE_MESSAGES = [
    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}
]


@pytest.mark.parametrize("status", [401, 403])
@pytest.mark.parametrize("refuser", ["preprocess", "encoder"])
def test_a_role_refusing_this_roles_token_is_upstream_unauthorized(
    context: RolloutContext, refuser: str, status: int
) -> None:
    """A 401/403 from the preprocess or encoder role is not the caller's 401 (nor a media refusal,
    nor an encoder to route around): it is `UpstreamUnauthorized`, naming the role."""
    refusal = {"error": {"code": "unauthorized", "message": "missing or wrong bearer token"}}
    item = {"index": 0, "type": "image", "num_tokens": 4, "tokens_unbudgeted": 4, "key": "f" * 40}
    items = {"items": [item], "num_tokens": 4}

    def preprocess(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, json=refusal) if refuser == "preprocess" else httpx.Response(200, json=items)

    def encoder(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, json=refusal)

    async def run() -> None:
        async with (
            httpx.AsyncClient(base_url="http://p", transport=httpx.MockTransport(preprocess)) as p,
            httpx.AsyncClient(base_url="http://e", transport=httpx.MockTransport(encoder)) as e,
        ):
            context.preprocess = AsyncPreprocessClient("http://p", http=p)
            context.encoder = AsyncEncoderClient("http://e", http=e)
            await prepare(context, IMAGE_MESSAGES, where="prompts[0].messages", budget=None)

    with pytest.raises(UpstreamUnauthorized) as refused:
        asyncio.run(run())
    assert refused.value.code == "upstream_unauthorized" and refused.value.role == refuser
    assert refused.value.status == status and f"the {refuser} role" in str(refused.value)


def test_a_403_naming_the_requests_own_fault_stays_a_media_refusal(context: RolloutContext) -> None:
    """The preprocess role answers 403 ``path_not_allowed`` for a path outside its media roots: the
    request's fault, passed on with its status and code (not a refused token)."""
    refusal = {"error": {"code": "path_not_allowed", "message": "'/etc' is outside the media roots", "item": 0}}

    async def run() -> None:
        transport = httpx.MockTransport(lambda _: httpx.Response(403, json=refusal))
        async with httpx.AsyncClient(base_url="http://p", transport=transport) as p:
            context.preprocess = AsyncPreprocessClient("http://p", http=p)
            await prepare(context, IMAGE_MESSAGES, where="prompts[0].messages", budget=None)

    with pytest.raises(MediaRefused) as refused:
        asyncio.run(run())
    assert (refused.value.status, refused.value.code, refused.value.item) == (403, "path_not_allowed", 0)


ITEM = {"index": 0, "type": "image", "num_tokens": 4, "tokens_unbudgeted": 4, "key": "f" * 40}


def _no_answer(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


def _preprocessed(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={"items": [ITEM], "num_tokens": 4})


@contextmanager
def _role(handler: Any) -> Iterator[str]:
    """A role on a loopback port answering every request with ``handler``'s answer (``_no_answer``: a port nothing
    listens on), so the clients and `prepare` meet a real server's answers, refusals and failures."""
    if handler is _no_answer:
        yield f"http://127.0.0.1:{free_port()}"
        return

    async def answer(request: Request) -> Response:
        made = handler(httpx.Request(request.method, str(request.url), content=await request.body()))
        return Response(made.content, status_code=made.status_code, media_type="application/json")

    with RunningServer(Starlette(routes=[Route("/{path:path}", answer, methods=["GET", "POST"])])) as server:
        yield server.url


async def _prepare_with(context: RolloutContext, preprocess: Any, encoder: Any = None) -> Prepared:
    """`prepare` of an image prompt, the two roles (real servers on loopback) answering with these handlers
    (``encoder`` None: no encoder role)."""
    with _role(preprocess) as p, _role(encoder or _no_answer) as e:
        async with AsyncPreprocessClient(p) as preprocessing, AsyncEncoderClient(e) as encoding:
            context.preprocess = preprocessing
            context.encoder = encoding if encoder is not None else None
            return await prepare(context, IMAGE_MESSAGES, where="prompts[0].messages", budget=None)


@pytest.mark.parametrize(
    ("answer", "status", "code", "item"),
    [
        (_no_answer, None, "preprocess_unavailable", None),
        (
            lambda _: httpx.Response(415, json={"error": {"code": "unsupported_media", "message": "?", "item": 0}}),
            415,
            "unsupported_media",
            0,
        ),
        (
            lambda _: httpx.Response(500, json={"error": {"code": "internal_error", "message": "see its log"}}),
            502,
            "preprocess_failed",
            None,
        ),
        (
            lambda _: httpx.Response(200, json={"items": [{**ITEM, "num_tokens": "four"}], "num_tokens": 4}),
            502,
            "preprocess_failed",
            None,
        ),
        (
            lambda _: httpx.Response(200, json={"items": [{**ITEM, "key": None}], "num_tokens": 4}),
            502,
            "preprocess_failed",
            None,
        ),
    ],
    ids=["no-answer", "refused", "failed", "mutated", "no-key"],
)
def test_the_preprocess_roles_failures_are_this_roles_errors(
    context: RolloutContext, answer: Any, status: int | None, code: str, item: int | None
) -> None:
    """No answer: 503 ``preprocess_unavailable``; a refusal: its status, code and item; the role failing or
    answering what is not its record (through `preprocess.client`): 502 ``preprocess_failed``."""
    with pytest.raises((MediaRefused, UpstreamUnavailable)) as failed:
        asyncio.run(_prepare_with(context, answer))
    assert failed.value.code == code
    if status is None:
        assert isinstance(failed.value, UpstreamUnavailable)
    else:
        assert isinstance(failed.value, MediaRefused) and (failed.value.status, failed.value.item) == (status, item)


@pytest.mark.parametrize(
    "encoder",
    [
        _no_answer,
        lambda _: httpx.Response(500, json={"error": {"code": "internal_error", "message": "see its log"}}),
        lambda _: httpx.Response(404, json={"error": {"code": "features_not_found", "message": "?", "item": 0}}),
        lambda _: httpx.Response(200, json={"version": "v", "items": [{"embedding_key": "e" * 40}]}),
    ],
    ids=["no-answer", "failed", "refused", "mutated"],
)
def test_an_encoder_that_does_not_give_embeddings_is_routed_around(context: RolloutContext, encoder: Any) -> None:
    """The engines then encode: the media go by feature key."""
    prepared = asyncio.run(_prepare_with(context, _preprocessed, encoder))
    assert prepared.media == [MediaRef(type="image", feature_key="f" * 40)] and prepared.feature_keys == ["f" * 40]


def test_an_encoder_gives_embedding_keys(context: RolloutContext) -> None:
    encoded = {"feature_key": "f" * 40, "embedding_key": "e" * 40, "type": "image", "shape": [4, 8], "cache_hit": False}
    prepared = asyncio.run(
        _prepare_with(context, _preprocessed, lambda _: httpx.Response(200, json={"version": "v", "items": [encoded]}))
    )
    assert prepared.media == [MediaRef(type="image", embedding_key="e" * 40)] and prepared.token_counts["image"] == 4
