"""The engine role's clients: one typed method per route of SGLang's native API that Weir's callers use, each
body built and each answer read through its record (`engines.api`). The same client drives Weir's engine
role and a plain SGLang server (the records take what either answers; `engines.api` says how).

Errors are `wire.client`'s, naming the role: `RoleUnavailable` (no answer, a 5xx), `RoleUnauthorized`
(401/403), `RoleRefused` (a 4xx with its code; SGLang's ``success: false`` weight refusals are 400s),
`AnswerMismatch` (a 2xx that is not the route's record). A streamed request's error event is raised when it
comes, as `wire.client.read_json_line` raises a role's error line: `RoleUnavailable` with code
``internal_error`` for the engine's own failure, else `RoleRefused` with the event's code (``http_200`` when
it names none, as SGLang's does — the wire's rule for a refusal without a code) and ``status`` 200 (the
stream had started).

Retries (``retry_s``) only where a call is safe to repeat: the reads, ``/abort_request``,
``/pause_generation``, ``/continue_generation`` and ``/flush_cache``; never a generation or a weight update.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from types import NoneType
from typing import Any, TypeVar

import httpx
import orjson
from pydantic import BaseModel, TypeAdapter, ValidationError

from wire.client import (
    AnswerMismatch,
    AsyncRoleClient,
    CallOptions,
    Get,
    Post,
    RoleClient,
    RoleRefused,
    RoleUnavailable,
    RouteKeywords,
)

from .api import (
    AbortBody,
    ContinueBody,
    ControlResponse,
    DestroyWeightsGroupBody,
    GenerateBody,
    GenerateResponse,
    InitWeightsGroupBody,
    ModelInfo,
    ModelList,
    PauseBody,
    ServerInfo,
    UpdateWeightsBody,
    UpdateWeightsFromDistributedBody,
    UpdateWeightsFromTensorBody,
    UpdateWeightsResponse,
    WeightVersion,
)

__all__ = ["AsyncEngineClient", "EngineClient", "body_json"]

T = TypeVar("T")
_ONCE = 0.0  # retry_s for calls that must not be repeated
_RESULT: TypeAdapter[GenerateResponse] = TypeAdapter(GenerateResponse)
_RESULTS: TypeAdapter[list[GenerateResponse]] = TypeAdapter(list[GenerateResponse])
_DONE = object()


def body_json(body: BaseModel) -> bytes:
    """``body``'s JSON: the fields set and the extra ones, as pydantic's ``exclude_unset`` dump writes them,
    written by orjson — a `/generate` body is sent per sample, and pydantic's serializer, walking a long
    prompt's ids through the union of a prompt and a batch, took several times orjson's time."""
    fields = {name: getattr(body, name) for name in body.model_fields_set}
    if body.model_extra:
        fields.update(body.model_extra)
    return orjson.dumps(fields, default=_nested)


def _nested(value: object) -> Any:
    if isinstance(value, BaseModel):  # `MediaRef`s in weir_media
        out = {name: getattr(value, name) for name in value.model_fields_set}
        return {**out, **value.model_extra} if value.model_extra else out
    raise TypeError(f"{type(value).__name__} is not JSON")


def _streamed(body: GenerateBody) -> bytes:
    return body_json(body if body.stream else body.model_copy(update={"stream": True}))


def _loaded(role: str, what: str, data: bytes | str) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        raise AnswerMismatch(role, f"{what} is not JSON: {data[:200]!r}", field="(the body)") from None


def _checked(role: str, what: str, value: Any, adapter: TypeAdapter[T], name: str) -> T:
    try:
        return adapter.validate_python(value)
    except ValidationError as invalid:
        first = invalid.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "(the body)"
        raise AnswerMismatch(role, f"{what} is not a {name}: {field}: {first['msg']}", field=field) from None


def _results(role: str, response: httpx.Response, adapter: TypeAdapter[T]) -> T:
    """A 2xx `/generate` answer read through its record, as `wire.client.read_answer` reads one, but parsed by
    orjson and then validated: pydantic's own JSON parser took 2-3 times orjson's time on a long answer's
    log-prob lists, and the rollout role reads one per sample."""
    what = f"the {role} role's answer to {response.request.method} {response.request.url.path}"
    return _checked(role, what, _loaded(role, what, response.content), adapter, "GenerateResponse")


def _event(role: str, line: str) -> GenerateResponse | object | None:
    """One line of an SSE answer: a chunk, `_DONE`, None (not an event), or the error the event reports."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return _DONE
    event = _loaded(role, f"a stream event of the {role} role", data)
    error = event.get("error") if isinstance(event, dict) else None
    if isinstance(error, dict):
        code, message = error.get("code"), str(error.get("message") or "failed")
        if code == "internal_error":  # as `wire.client.read_json_line` reads a role's failure mid-stream
            raise RoleUnavailable(role, f"the {role} role failed mid-stream: {message}", code="internal_error")
        index = event.get("index")
        raise RoleRefused(
            role,
            message,
            status=200,
            code=code if isinstance(code, str) else "http_200",
            item=index if isinstance(index, int) else None,
        )
    return _checked(role, f"the {role} role sent a stream chunk that", event, _RESULT, "GenerateResponse")


def _generating(body: GenerateBody, timeout_s: float | None) -> CallOptions:
    """A ``POST /generate``'s options: ``body`` written by `body_json`, never repeated."""
    return CallOptions(content=body_json(body), timeout_s=timeout_s, retry_s=_ONCE)


@contextmanager
def _streaming(role: str) -> Iterator[None]:
    """A stream's reading: an ``httpx`` error mid-stream raised as `RoleUnavailable`."""
    try:
        yield
    except httpx.HTTPError as error:
        raise RoleUnavailable(role, f"the {role} role stopped streaming: {type(error).__name__}: {error}") from None


_EACH = RouteKeywords(arg="body", takes=("timeout_s",))  # every route: its body named ``body``, a per-call timeout
_WEIGHTS = RouteKeywords(**_EACH, retry_s=_ONCE)  # a weight update: never repeated


class _EngineRoutes:
    """SGLang's routes that are a body (or none) in and a record out."""

    role = "engine"

    abort_request = Post(
        "/abort_request",
        AbortBody,
        NoneType,
        doc="Abort the request ``body.rid`` names, or all (an unknown rid is no error: it may have finished).",
        **_EACH,
    )
    pause_generation = Post(
        "/pause_generation",
        PauseBody,
        ControlResponse,
        default=PauseBody,
        doc="Pause generation (``body.mode``: what becomes of the running requests; `PauseBody`).",
        **_EACH,
    )
    continue_generation = Post(
        "/continue_generation", ContinueBody, ControlResponse, default=ContinueBody, doc="Resume generation.", **_EACH
    )
    flush_cache = Post(
        "/flush_cache", None, NoneType, doc="Drop the prefix cache (a 400 while requests hold KV).", **_EACH
    )
    update_weights_from_disk = Post(
        "/update_weights_from_disk",
        UpdateWeightsBody,
        UpdateWeightsResponse,
        doc="Load the weights at ``body.model_path`` (``success: false``, a 400: they did not load).",
        **_WEIGHTS,
    )
    init_weights_update_group = Post(
        "/init_weights_update_group",
        InitWeightsGroupBody,
        ControlResponse,
        doc="Join the trainer's weight broadcast group (answered once its rank 0 has joined too).",
        **_WEIGHTS,
    )
    update_weights_from_distributed = Post(
        "/update_weights_from_distributed",
        UpdateWeightsFromDistributedBody,
        ControlResponse,
        doc="Receive the tensors ``body`` names from the weight broadcast group.",
        **_WEIGHTS,
    )
    update_weights_from_tensor = Post(
        "/update_weights_from_tensor",
        UpdateWeightsFromTensorBody,
        ControlResponse,
        doc="Load the serialized tensors ``body`` carries.",
        **_WEIGHTS,
    )
    destroy_weights_update_group = Post(
        "/destroy_weights_update_group",
        DestroyWeightsGroupBody,
        ControlResponse,
        default=DestroyWeightsGroupBody,
        doc="Leave the weight broadcast group ``body.group_name`` names.",
        **_WEIGHTS,
    )
    health = Get(
        "/health",
        NoneType,
        doc="SGLang's liveness: returns when healthy (200), `RoleUnavailable` when not (503).",
        **_EACH,
    )
    health_generate = Get(
        "/health_generate",
        NoneType,
        doc="A one-token generation now: `RoleUnavailable` (503) when none comes.",
        **_EACH,
    )
    get_weight_version = Get("/get_weight_version", WeightVersion, doc="The version of the weights served.", **_EACH)
    model_info = Get("/model_info", ModelInfo, doc="What is served (`ModelInfo`).", **_EACH)
    get_model_info = Get("/get_model_info", ModelInfo, doc="`model_info` under SGLang's older name.", **_EACH)
    server_info = Get("/server_info", ServerInfo, doc="The server's settings and state (`ServerInfo`).", **_EACH)
    get_server_info = Get("/get_server_info", ServerInfo, doc="`server_info` under SGLang's older name.", **_EACH)
    models = Get("/v1/models", ModelList, doc="OpenAI's ``GET /v1/models``: the models served.", **_EACH)


class EngineClient(_EngineRoutes, RoleClient):
    """Weir's engine role, or an SGLang server, at ``url`` (no ``/v1`` prefix: SGLang's native routes)."""

    def generate(self, body: GenerateBody, *, timeout_s: float | None = None) -> GenerateResponse:
        """One prompt, one sample (a batch or n > 1: `generate_batch`; events: `generate_stream`)."""
        return _results(self.role, self.send("POST", "/generate", **_generating(body, timeout_s)), _RESULT)

    def generate_batch(self, body: GenerateBody, *, timeout_s: float | None = None) -> list[GenerateResponse]:
        """A batch or n > 1: every result, item-major (SGLang's order)."""
        return _results(self.role, self.send("POST", "/generate", **_generating(body, timeout_s)), _RESULTS)

    @contextmanager
    def generate_stream(
        self, body: GenerateBody, *, timeout_s: float | None = None
    ) -> Iterator[Iterator[GenerateResponse]]:
        """``body`` with ``stream: true``: its chunks as they come (cumulative, as SGLang's), until ``[DONE]``;
        a refusal is raised on entering, an error event where it comes."""
        with self.stream("POST", "/generate", content=_streamed(body), timeout_s=timeout_s) as lines:
            yield self._chunks(lines)

    def _chunks(self, lines: Iterator[str]) -> Iterator[GenerateResponse]:
        with _streaming(self.role):
            for line in lines:
                if (chunk := _event(self.role, line)) is _DONE:
                    return
                if chunk is not None:
                    yield chunk  # type: ignore[misc]


class AsyncEngineClient(_EngineRoutes, AsyncRoleClient):
    """The asynchronous twin of `EngineClient` (the rollout role's dispatcher shares its ``httpx.AsyncClient``)."""

    async def generate(self, body: GenerateBody, *, timeout_s: float | None = None) -> GenerateResponse:
        """As `EngineClient.generate`."""
        return _results(self.role, await self.send("POST", "/generate", **_generating(body, timeout_s)), _RESULT)

    async def generate_batch(self, body: GenerateBody, *, timeout_s: float | None = None) -> list[GenerateResponse]:
        """As `EngineClient.generate_batch`."""
        return _results(self.role, await self.send("POST", "/generate", **_generating(body, timeout_s)), _RESULTS)

    @asynccontextmanager
    async def generate_stream(
        self, body: GenerateBody, *, timeout_s: float | None = None
    ) -> AsyncIterator[AsyncIterator[GenerateResponse]]:
        """As `EngineClient.generate_stream`."""
        async with self.stream("POST", "/generate", content=_streamed(body), timeout_s=timeout_s) as lines:
            yield self._chunks(lines)

    async def _chunks(self, lines: AsyncIterator[str]) -> AsyncIterator[GenerateResponse]:
        with _streaming(self.role):
            async for line in lines:
                if (chunk := _event(self.role, line)) is _DONE:
                    return
                if chunk is not None:
                    yield chunk  # type: ignore[misc]
