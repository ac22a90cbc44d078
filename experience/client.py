"""The data role's clients: `DataClient` (sync: the trainer's feed, driver and publisher) and `AsyncDataClient`
(async: the rollout role's sink) — one typed method per route, each answer read into its `experience.api` record.

Token, timeouts, retries and the errors (`wire.client.RoleUnavailable`, `RoleUnauthorized`, `RoleRefused`,
`AnswerMismatch`) are `wire.client`'s. Only idempotent routes take the client's ``retry_s``: storing groups
(idempotent by group id), acks, release, the policy version and the reads. A micro-batch fetch leases a batch and
`regenerations` hands each group id out once, so neither is ever sent twice by the client.

Groups go out as JSON encoded once (`experience.wire`, orjson; bytes already encoded are sent as they are): a
retried body is not encoded again. A micro-batch comes back as an Arrow IPC stream: its envelope — the
``X-Weir-Batch-Id`` header, the schema metadata ``weir``, the columns every trainer reads — is checked when read;
its rows are Arrow's, never validated one by one (that would cost the feed its speed).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import httpx
import pyarrow as pa
from pydantic import TypeAdapter, ValidationError
from typing_extensions import TypedDict, Unpack

# The micro-batch answer is an Arrow stream, not a record `call` reads: its request is sent here, with the
# base's own verdict on a refusal and its own error for a role that did not answer.
from wire.client import AnswerMismatch, AsyncRoleClient, Get, Post, RoleClient

from . import wire
from .api import (
    BATCH_ID_HEADER,
    BATCH_ID_PATTERN,
    AckOut,
    AcksIn,
    AcksOut,
    AdmissionOut,
    ExperienceOut,
    HealthOut,
    MicroBatchDelivery,
    PolicyIn,
    PolicyOut,
    ReadyOut,
    RegenerationsOut,
    ReleaseOut,
    StatsOut,
)
from .records import MICROBATCH_SCHEMA, BatchMeta, Group

__all__ = ["AsyncDataClient", "DataClient", "read_delivery"]

ROLE = "data"
_MICROBATCHES = "/v1/microbatches"
_META: TypeAdapter[BatchMeta] = TypeAdapter(BatchMeta)
# The columns of every micro-batch since microbatch/1 (policy_versions came with /2, routed_experts with /3).
_REQUIRED = [f for f in MICROBATCH_SCHEMA if f.name not in ("policy_versions", "routed_experts")]

Experience = Group | Sequence[Group] | bytes
"""A body of ``POST /v1/experience``: one group, several (``{"groups": [...]}``), or either already encoded."""


def _experience_body(body: Experience) -> bytes:
    if isinstance(body, bytes):
        return body
    if isinstance(body, Group):
        return wire.dumps(body.to_json())
    return wire.dumps({"groups": [group.to_json() for group in body]})


class Poll(TypedDict, total=False):
    """What a ``GET /v1/microbatches`` long poll asks for; what is not given is the default in brackets."""

    consumer: str  # ("trainer")
    rank: int  # (0)
    world_size: int  # (1)
    max_tokens: int  # (8192)
    max_samples: int | None  # (no bound)
    wait_s: float  # (10.0): how long the role holds the poll before answering 204
    inline_media: bool  # (False)
    timeout_s: float | None  # (the client's)


def _poll_params(poll: Poll) -> dict[str, str | int | float]:
    params: dict[str, str | int | float] = {
        "consumer": poll.get("consumer", "trainer"),
        "rank": poll.get("rank", 0),
        "world_size": poll.get("world_size", 1),
        "max_tokens": poll.get("max_tokens", 8192),
        "wait_s": poll.get("wait_s", 10.0),
    }
    if (max_samples := poll.get("max_samples")) is not None:
        params["max_samples"] = max_samples
    if poll.get("inline_media", False):
        params["inline_media"] = "true"
    return params


def _mismatch(message: str, field: str) -> AnswerMismatch:
    return AnswerMismatch(
        ROLE, f"the {ROLE} role's answer to GET {_MICROBATCHES} is not a micro-batch: {message}", field=field
    )


def read_delivery(response: httpx.Response) -> MicroBatchDelivery | None:
    """A ``GET /v1/microbatches`` answer: None for 204 (nothing ready within ``wait_s``), else the delivery, its
    envelope checked (a refusal was raised by `send`)."""
    if response.status_code == 204:
        return None
    batch_id = response.headers.get(BATCH_ID_HEADER)
    if batch_id is None or not re.fullmatch(BATCH_ID_PATTERN, batch_id):
        raise _mismatch(f"the {BATCH_ID_HEADER} header is {batch_id!r}", BATCH_ID_HEADER)
    try:
        table = pa.ipc.open_stream(response.content).read_all()
    except pa.ArrowException as error:
        raise _mismatch(f"the body is not an Arrow IPC stream ({error})", "(the body)") from None
    schema = table.schema
    raw = (schema.metadata or {}).get(b"weir")
    if raw is None:
        raise _mismatch("its schema metadata has no 'weir'", "weir")
    try:
        meta = _META.validate_json(raw)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(["weir", *(str(p) for p in first["loc"])])
        raise _mismatch(f"{where}: {first['msg']}", where) from None
    for column in _REQUIRED:
        index = schema.get_field_index(column.name)
        if index < 0:
            raise _mismatch(f"it has no column {column.name!r}", column.name)
        kind = schema.field(index).type
        if not kind.equals(column.type):
            raise _mismatch(f"column {column.name!r} is {kind}, not {column.type}", column.name)
    return MicroBatchDelivery(batch_id=batch_id, table=table, meta=meta)


def _acks(batch_ids: Sequence[str]) -> AcksIn:
    return AcksIn.model_construct(batch_ids=list(batch_ids))  # the role judges the ids (422 naming one)


def _release_params(consumer: str, rank: int | None) -> dict[str, str | int]:
    return {"consumer": consumer, **({"rank": rank} if rank is not None else {})}


def _admission_params(consumer: str, groups_per_step: int | None) -> dict[str, str | int]:
    return {"consumer": consumer, **({"groups_per_step": groups_per_step} if groups_per_step is not None else {})}


def _policy(version: int) -> PolicyIn:
    # Not validated here: the role refuses a bad version with its own status and code, as it always has.
    return PolicyIn.model_construct(version=version)


class _DataRoutes:
    role = ROLE

    ack = Post(
        "/v1/microbatches/{batch_id}/ack",
        str,
        AckOut,
        takes=("retry_s",),
        doc="``POST /v1/microbatches/{id}/ack``: the batch was trained (409 ``lease_expired``: it went out again).",
    )
    regenerations = Post(
        "/v1/regenerations",
        None,
        RegenerationsOut,
        retry_s=0.0,
        doc="``POST /v1/regenerations``: the prompts to send again, each handed out once (never retried).",
    )
    health = Get("/healthz", HealthOut, doc="``GET /healthz``: the process answers.")
    ready = Get(
        "/readyz",
        ReadyOut,
        doc="``GET /readyz``: the store can write (503, `wire.client.RoleUnavailable`, while it cannot).",
    )


class DataClient(_DataRoutes, RoleClient):
    """The data role, synchronously (``url``: its base URL; see `wire.client.RoleClient` for the rest)."""

    def store(self, body: Experience, *, retry_s: float | None = None) -> ExperienceOut:
        """``POST /v1/experience``: durable when answered; a group stored before is listed in ``duplicates``."""
        return self.call("POST", "/v1/experience", ExperienceOut, content=_experience_body(body), retry_s=retry_s)

    def microbatch(self, **poll: Unpack[Poll]) -> MicroBatchDelivery | None:
        """``GET /v1/microbatches``, a long poll of up to ``wait_s``: the next batch leased to ``rank``, or None
        when none was ready. Never retried (each answer leases a batch)."""
        params, timeout_s = _poll_params(poll), poll.get("timeout_s")
        return read_delivery(self.send("GET", _MICROBATCHES, params=params, timeout_s=timeout_s, retry_s=0))

    def ack_all(self, batch_ids: Sequence[str], *, retry_s: float | None = None) -> AcksOut:
        """``POST /v1/microbatches/ack``: a step's batches in one transaction."""
        return self.call("POST", f"{_MICROBATCHES}/ack", AcksOut, body=_acks(batch_ids), retry_s=retry_s)

    def release(self, *, consumer: str = "trainer", rank: int | None = None) -> ReleaseOut:
        """``POST /v1/microbatches/release``: the consumer's (or one rank's) unacknowledged batches, back now."""
        return self.call("POST", f"{_MICROBATCHES}/release", ReleaseOut, params=_release_params(consumer, rank))

    def admission(self, *, consumer: str = "trainer", groups_per_step: int | None = None) -> AdmissionOut:
        """``GET /v1/admission``: how many more groups the producer may start, and the policy version. A producer
        filling steps of ``groups_per_step`` groups says so: the data role sizes the queue from it."""
        params = _admission_params(consumer, groups_per_step)
        return self.call("GET", "/v1/admission", AdmissionOut, params=params)

    def announce_policy(self, version: int) -> PolicyOut:
        """``POST /v1/policy``: the trainer's new policy version (409 ``policy_regression`` below the current)."""
        return self.call("POST", "/v1/policy", PolicyOut, body=_policy(version))

    def stats(self, *, consumer: str = "trainer") -> StatsOut:
        """``GET /v1/stats``: the store's counts, for one consumer's queue."""
        return self.call("GET", "/v1/stats", StatsOut, params={"consumer": consumer})


class AsyncDataClient(_DataRoutes, AsyncRoleClient):
    """The data role, asynchronously: the methods of `DataClient`, awaited."""

    async def store(self, body: Experience, *, retry_s: float | None = None) -> ExperienceOut:
        """As `DataClient.store`."""
        content = _experience_body(body)
        return await self.call("POST", "/v1/experience", ExperienceOut, content=content, retry_s=retry_s)

    async def microbatch(self, **poll: Unpack[Poll]) -> MicroBatchDelivery | None:
        """As `DataClient.microbatch`."""
        params, timeout_s = _poll_params(poll), poll.get("timeout_s")
        return read_delivery(await self.send("GET", _MICROBATCHES, params=params, timeout_s=timeout_s, retry_s=0))

    async def ack_all(self, batch_ids: Sequence[str], *, retry_s: float | None = None) -> AcksOut:
        """As `DataClient.ack_all`."""
        return await self.call("POST", f"{_MICROBATCHES}/ack", AcksOut, body=_acks(batch_ids), retry_s=retry_s)

    async def release(self, *, consumer: str = "trainer", rank: int | None = None) -> ReleaseOut:
        """As `DataClient.release`."""
        params = _release_params(consumer, rank)
        return await self.call("POST", f"{_MICROBATCHES}/release", ReleaseOut, params=params)

    async def admission(self, *, consumer: str = "trainer", groups_per_step: int | None = None) -> AdmissionOut:
        """As `DataClient.admission`."""
        params = _admission_params(consumer, groups_per_step)
        return await self.call("GET", "/v1/admission", AdmissionOut, params=params)

    async def announce_policy(self, version: int) -> PolicyOut:
        """As `DataClient.announce_policy`."""
        return await self.call("POST", "/v1/policy", PolicyOut, body=_policy(version))

    async def stats(self, *, consumer: str = "trainer") -> StatsOut:
        """As `DataClient.stats`."""
        return await self.call("GET", "/v1/stats", StatsOut, params={"consumer": consumer})
