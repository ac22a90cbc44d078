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
from typing import Any, TypeVar

import httpx
import orjson
from pydantic import BaseModel, TypeAdapter, ValidationError

from wire.client import Acknowledged, AnswerMismatch, AsyncRoleClient, RoleClient, RoleRefused, RoleUnavailable

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


def _stopped(role: str, error: httpx.HTTPError) -> RoleUnavailable:
    return RoleUnavailable(role, f"the {role} role stopped streaming: {type(error).__name__}: {error}")


class EngineClient(RoleClient):
    """Weir's engine role, or an SGLang server, at ``url`` (no ``/v1`` prefix: SGLang's native routes)."""

    role = "engine"

    def generate(self, body: GenerateBody, *, timeout_s: float | None = None) -> GenerateResponse:
        """One prompt, one sample (a batch or n > 1: `generate_batch`; events: `generate_stream`)."""
        sent = self.send("POST", "/generate", content=body_json(body), timeout_s=timeout_s, retry_s=_ONCE)
        return _results(self.role, sent, _RESULT)

    def generate_batch(self, body: GenerateBody, *, timeout_s: float | None = None) -> list[GenerateResponse]:
        """A batch or n > 1: every result, item-major (SGLang's order)."""
        sent = self.send("POST", "/generate", content=body_json(body), timeout_s=timeout_s, retry_s=_ONCE)
        return _results(self.role, sent, _RESULTS)

    @contextmanager
    def generate_stream(
        self, body: GenerateBody, *, timeout_s: float | None = None
    ) -> Iterator[Iterator[GenerateResponse]]:
        """``body`` with ``stream: true``: its chunks as they come (cumulative, as SGLang's), until ``[DONE]``;
        a refusal is raised on entering, an error event where it comes."""
        with self.stream("POST", "/generate", content=_streamed(body), timeout_s=timeout_s) as lines:
            yield self._chunks(lines)

    def _chunks(self, lines: Iterator[str]) -> Iterator[GenerateResponse]:
        try:
            for line in lines:
                chunk = _event(self.role, line)
                if chunk is _DONE:
                    return
                if chunk is not None:
                    yield chunk  # type: ignore[misc]
        except httpx.HTTPError as error:
            raise _stopped(self.role, error) from None

    def abort_request(self, body: AbortBody, *, timeout_s: float | None = None) -> None:
        self.call("POST", "/abort_request", Acknowledged, body=body, timeout_s=timeout_s)

    def pause_generation(self, body: PauseBody | None = None, *, timeout_s: float | None = None) -> ControlResponse:
        return self.call("POST", "/pause_generation", ControlResponse, body=body or PauseBody(), timeout_s=timeout_s)

    def continue_generation(
        self, body: ContinueBody | None = None, *, timeout_s: float | None = None
    ) -> ControlResponse:
        return self.call(
            "POST", "/continue_generation", ControlResponse, body=body or ContinueBody(), timeout_s=timeout_s
        )

    def flush_cache(self, *, timeout_s: float | None = None) -> None:
        self.call("POST", "/flush_cache", Acknowledged, timeout_s=timeout_s)

    def update_weights_from_disk(
        self, body: UpdateWeightsBody, *, timeout_s: float | None = None
    ) -> UpdateWeightsResponse:
        return self.call(
            "POST", "/update_weights_from_disk", UpdateWeightsResponse, body=body, timeout_s=timeout_s, retry_s=_ONCE
        )

    def init_weights_update_group(
        self, body: InitWeightsGroupBody, *, timeout_s: float | None = None
    ) -> ControlResponse:
        return self.call(
            "POST", "/init_weights_update_group", ControlResponse, body=body, timeout_s=timeout_s, retry_s=_ONCE
        )

    def update_weights_from_distributed(
        self, body: UpdateWeightsFromDistributedBody, *, timeout_s: float | None = None
    ) -> ControlResponse:
        return self.call(
            "POST", "/update_weights_from_distributed", ControlResponse, body=body, timeout_s=timeout_s, retry_s=_ONCE
        )

    def update_weights_from_tensor(
        self, body: UpdateWeightsFromTensorBody, *, timeout_s: float | None = None
    ) -> ControlResponse:
        return self.call(
            "POST", "/update_weights_from_tensor", ControlResponse, body=body, timeout_s=timeout_s, retry_s=_ONCE
        )

    def destroy_weights_update_group(
        self, body: DestroyWeightsGroupBody | None = None, *, timeout_s: float | None = None
    ) -> ControlResponse:
        return self.call(
            "POST",
            "/destroy_weights_update_group",
            ControlResponse,
            body=body or DestroyWeightsGroupBody(),
            timeout_s=timeout_s,
            retry_s=_ONCE,
        )

    def health(self, *, timeout_s: float | None = None) -> None:
        """SGLang's liveness: returns when healthy (200), `RoleUnavailable` when not (503)."""
        self.call("GET", "/health", Acknowledged, timeout_s=timeout_s)

    def health_generate(self, *, timeout_s: float | None = None) -> None:
        self.call("GET", "/health_generate", Acknowledged, timeout_s=timeout_s)

    def get_weight_version(self, *, timeout_s: float | None = None) -> WeightVersion:
        return self.call("GET", "/get_weight_version", WeightVersion, timeout_s=timeout_s)

    def model_info(self, *, timeout_s: float | None = None) -> ModelInfo:
        return self.call("GET", "/model_info", ModelInfo, timeout_s=timeout_s)

    def get_model_info(self, *, timeout_s: float | None = None) -> ModelInfo:
        """`model_info` under SGLang's older name."""
        return self.call("GET", "/get_model_info", ModelInfo, timeout_s=timeout_s)

    def server_info(self, *, timeout_s: float | None = None) -> ServerInfo:
        return self.call("GET", "/server_info", ServerInfo, timeout_s=timeout_s)

    def get_server_info(self, *, timeout_s: float | None = None) -> ServerInfo:
        """`server_info` under SGLang's older name."""
        return self.call("GET", "/get_server_info", ServerInfo, timeout_s=timeout_s)

    def models(self, *, timeout_s: float | None = None) -> ModelList:
        return self.call("GET", "/v1/models", ModelList, timeout_s=timeout_s)


class AsyncEngineClient(AsyncRoleClient):
    """The asynchronous twin of `EngineClient` (the rollout role's dispatcher shares its ``httpx.AsyncClient``)."""

    role = "engine"

    async def generate(self, body: GenerateBody, *, timeout_s: float | None = None) -> GenerateResponse:
        sent = await self.send("POST", "/generate", content=body_json(body), timeout_s=timeout_s, retry_s=_ONCE)
        return _results(self.role, sent, _RESULT)

    async def generate_batch(self, body: GenerateBody, *, timeout_s: float | None = None) -> list[GenerateResponse]:
        sent = await self.send("POST", "/generate", content=body_json(body), timeout_s=timeout_s, retry_s=_ONCE)
        return _results(self.role, sent, _RESULTS)

    @asynccontextmanager
    async def generate_stream(
        self, body: GenerateBody, *, timeout_s: float | None = None
    ) -> AsyncIterator[AsyncIterator[GenerateResponse]]:
        async with self.stream("POST", "/generate", content=_streamed(body), timeout_s=timeout_s) as lines:
            yield self._chunks(lines)

    async def _chunks(self, lines: AsyncIterator[str]) -> AsyncIterator[GenerateResponse]:
        try:
            async for line in lines:
                chunk = _event(self.role, line)
                if chunk is _DONE:
                    return
                if chunk is not None:
                    yield chunk  # type: ignore[misc]
        except httpx.HTTPError as error:
            raise _stopped(self.role, error) from None

    async def abort_request(self, body: AbortBody, *, timeout_s: float | None = None) -> None:
        await self.call("POST", "/abort_request", Acknowledged, body=body, timeout_s=timeout_s)

    async def pause_generation(
        self, body: PauseBody | None = None, *, timeout_s: float | None = None
    ) -> ControlResponse:
        return await self.call(
            "POST", "/pause_generation", ControlResponse, body=body or PauseBody(), timeout_s=timeout_s
        )

    async def continue_generation(
        self, body: ContinueBody | None = None, *, timeout_s: float | None = None
    ) -> ControlResponse:
        return await self.call(
            "POST", "/continue_generation", ControlResponse, body=body or ContinueBody(), timeout_s=timeout_s
        )

    async def flush_cache(self, *, timeout_s: float | None = None) -> None:
        await self.call("POST", "/flush_cache", Acknowledged, timeout_s=timeout_s)

    async def update_weights_from_disk(
        self, body: UpdateWeightsBody, *, timeout_s: float | None = None
    ) -> UpdateWeightsResponse:
        return await self.call(
            "POST", "/update_weights_from_disk", UpdateWeightsResponse, body=body, timeout_s=timeout_s, retry_s=_ONCE
        )

    async def init_weights_update_group(
        self, body: InitWeightsGroupBody, *, timeout_s: float | None = None
    ) -> ControlResponse:
        return await self.call(
            "POST", "/init_weights_update_group", ControlResponse, body=body, timeout_s=timeout_s, retry_s=_ONCE
        )

    async def update_weights_from_distributed(
        self, body: UpdateWeightsFromDistributedBody, *, timeout_s: float | None = None
    ) -> ControlResponse:
        return await self.call(
            "POST", "/update_weights_from_distributed", ControlResponse, body=body, timeout_s=timeout_s, retry_s=_ONCE
        )

    async def update_weights_from_tensor(
        self, body: UpdateWeightsFromTensorBody, *, timeout_s: float | None = None
    ) -> ControlResponse:
        return await self.call(
            "POST", "/update_weights_from_tensor", ControlResponse, body=body, timeout_s=timeout_s, retry_s=_ONCE
        )

    async def destroy_weights_update_group(
        self, body: DestroyWeightsGroupBody | None = None, *, timeout_s: float | None = None
    ) -> ControlResponse:
        return await self.call(
            "POST",
            "/destroy_weights_update_group",
            ControlResponse,
            body=body or DestroyWeightsGroupBody(),
            timeout_s=timeout_s,
            retry_s=_ONCE,
        )

    async def health(self, *, timeout_s: float | None = None) -> None:
        await self.call("GET", "/health", Acknowledged, timeout_s=timeout_s)

    async def health_generate(self, *, timeout_s: float | None = None) -> None:
        await self.call("GET", "/health_generate", Acknowledged, timeout_s=timeout_s)

    async def get_weight_version(self, *, timeout_s: float | None = None) -> WeightVersion:
        return await self.call("GET", "/get_weight_version", WeightVersion, timeout_s=timeout_s)

    async def model_info(self, *, timeout_s: float | None = None) -> ModelInfo:
        return await self.call("GET", "/model_info", ModelInfo, timeout_s=timeout_s)

    async def get_model_info(self, *, timeout_s: float | None = None) -> ModelInfo:
        return await self.call("GET", "/get_model_info", ModelInfo, timeout_s=timeout_s)

    async def server_info(self, *, timeout_s: float | None = None) -> ServerInfo:
        return await self.call("GET", "/server_info", ServerInfo, timeout_s=timeout_s)

    async def get_server_info(self, *, timeout_s: float | None = None) -> ServerInfo:
        return await self.call("GET", "/get_server_info", ServerInfo, timeout_s=timeout_s)

    async def models(self, *, timeout_s: float | None = None) -> ModelList:
        return await self.call("GET", "/v1/models", ModelList, timeout_s=timeout_s)
