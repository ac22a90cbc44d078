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
from typing import Any

import httpx
import pyarrow as pa
from pydantic import TypeAdapter, ValidationError

# The micro-batch answer is an Arrow stream, not a record `call` reads: its request is sent here, with the
# base's own verdict on a refusal and its own error for a role that did not answer.
from wire.client import AnswerMismatch, AsyncRoleClient, RoleClient

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


def _poll_params(
    consumer: str,
    rank: int,
    world_size: int,
    max_tokens: int,
    max_samples: int | None,
    wait_s: float,
    inline_media: bool,
) -> dict[str, Any]:
    params: dict[str, Any] = {
        "consumer": consumer,
        "rank": rank,
        "world_size": world_size,
        "max_tokens": max_tokens,
        "wait_s": wait_s,
    }
    if max_samples is not None:
        params["max_samples"] = max_samples
    if inline_media:
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


class DataClient(RoleClient):
    """The data role, synchronously (``url``: its base URL; see `wire.client.RoleClient` for the rest)."""

    role = ROLE

    def store(self, body: Experience, *, retry_s: float | None = None) -> ExperienceOut:
        """``POST /v1/experience``: durable when answered; a group stored before is listed in ``duplicates``."""
        return self.call("POST", "/v1/experience", ExperienceOut, content=_experience_body(body), retry_s=retry_s)

    def microbatch(
        self,
        *,
        consumer: str = "trainer",
        rank: int = 0,
        world_size: int = 1,
        max_tokens: int = 8192,
        max_samples: int | None = None,
        wait_s: float = 10.0,
        inline_media: bool = False,
        timeout_s: float | None = None,
    ) -> MicroBatchDelivery | None:
        """``GET /v1/microbatches``, a long poll of up to ``wait_s``: the next batch leased to ``rank``, or None
        when none was ready. Never retried (each answer leases a batch)."""
        params = _poll_params(consumer, rank, world_size, max_tokens, max_samples, wait_s, inline_media)
        return read_delivery(self.send("GET", _MICROBATCHES, params=params, timeout_s=timeout_s, retry_s=0))

    def ack(self, batch_id: str, *, retry_s: float | None = None) -> AckOut:
        """``POST /v1/microbatches/{id}/ack``: the batch was trained (409 ``lease_expired``: it went out again)."""
        return self.call("POST", f"{_MICROBATCHES}/{batch_id}/ack", AckOut, retry_s=retry_s)

    def ack_all(self, batch_ids: Sequence[str], *, retry_s: float | None = None) -> AcksOut:
        """``POST /v1/microbatches/ack``: a step's batches in one transaction."""
        body = AcksIn.model_construct(batch_ids=list(batch_ids))  # the role judges the ids (422 naming one)
        return self.call("POST", f"{_MICROBATCHES}/ack", AcksOut, body=body, retry_s=retry_s)

    def release(self, *, consumer: str = "trainer", rank: int | None = None) -> ReleaseOut:
        """``POST /v1/microbatches/release``: the consumer's (or one rank's) unacknowledged batches, back now."""
        params: dict[str, str | int] = {"consumer": consumer, **({"rank": rank} if rank is not None else {})}
        return self.call("POST", f"{_MICROBATCHES}/release", ReleaseOut, params=params)

    def regenerations(self) -> RegenerationsOut:
        """``POST /v1/regenerations``: the prompts to send again, each handed out once (never retried)."""
        return self.call("POST", "/v1/regenerations", RegenerationsOut, retry_s=0.0)

    def admission(self, *, consumer: str = "trainer") -> AdmissionOut:
        """``GET /v1/admission``: how many more groups the producer may start, and the policy version."""
        return self.call("GET", "/v1/admission", AdmissionOut, params={"consumer": consumer})

    def announce_policy(self, version: int) -> PolicyOut:
        """``POST /v1/policy``: the trainer's new policy version (409 ``policy_regression`` below the current)."""
        # Not validated here: the role refuses a bad version with its own status and code, as it always has.
        return self.call("POST", "/v1/policy", PolicyOut, body=PolicyIn.model_construct(version=version))

    def stats(self, *, consumer: str = "trainer") -> StatsOut:
        """``GET /v1/stats``: the store's counts, for one consumer's queue."""
        return self.call("GET", "/v1/stats", StatsOut, params={"consumer": consumer})

    def health(self) -> HealthOut:
        """``GET /healthz``: the process answers."""
        return self.call("GET", "/healthz", HealthOut)

    def ready(self) -> ReadyOut:
        """``GET /readyz``: the store can write (503, `wire.client.RoleUnavailable`, while it cannot)."""
        return self.call("GET", "/readyz", ReadyOut)


class AsyncDataClient(AsyncRoleClient):
    """The data role, asynchronously: the methods of `DataClient`, awaited."""

    role = ROLE

    async def store(self, body: Experience, *, retry_s: float | None = None) -> ExperienceOut:
        """As `DataClient.store`."""
        content = _experience_body(body)
        return await self.call("POST", "/v1/experience", ExperienceOut, content=content, retry_s=retry_s)

    async def microbatch(
        self,
        *,
        consumer: str = "trainer",
        rank: int = 0,
        world_size: int = 1,
        max_tokens: int = 8192,
        max_samples: int | None = None,
        wait_s: float = 10.0,
        inline_media: bool = False,
        timeout_s: float | None = None,
    ) -> MicroBatchDelivery | None:
        """As `DataClient.microbatch`."""
        params = _poll_params(consumer, rank, world_size, max_tokens, max_samples, wait_s, inline_media)
        return read_delivery(await self.send("GET", _MICROBATCHES, params=params, timeout_s=timeout_s, retry_s=0))

    async def ack(self, batch_id: str, *, retry_s: float | None = None) -> AckOut:
        """As `DataClient.ack`."""
        return await self.call("POST", f"{_MICROBATCHES}/{batch_id}/ack", AckOut, retry_s=retry_s)

    async def ack_all(self, batch_ids: Sequence[str], *, retry_s: float | None = None) -> AcksOut:
        """As `DataClient.ack_all`."""
        body = AcksIn.model_construct(batch_ids=list(batch_ids))
        return await self.call("POST", f"{_MICROBATCHES}/ack", AcksOut, body=body, retry_s=retry_s)

    async def release(self, *, consumer: str = "trainer", rank: int | None = None) -> ReleaseOut:
        """As `DataClient.release`."""
        params: dict[str, str | int] = {"consumer": consumer, **({"rank": rank} if rank is not None else {})}
        return await self.call("POST", f"{_MICROBATCHES}/release", ReleaseOut, params=params)

    async def regenerations(self) -> RegenerationsOut:
        """As `DataClient.regenerations`."""
        return await self.call("POST", "/v1/regenerations", RegenerationsOut, retry_s=0.0)

    async def admission(self, *, consumer: str = "trainer") -> AdmissionOut:
        """As `DataClient.admission`."""
        return await self.call("GET", "/v1/admission", AdmissionOut, params={"consumer": consumer})

    async def announce_policy(self, version: int) -> PolicyOut:
        """As `DataClient.announce_policy`."""
        return await self.call("POST", "/v1/policy", PolicyOut, body=PolicyIn.model_construct(version=version))

    async def stats(self, *, consumer: str = "trainer") -> StatsOut:
        """As `DataClient.stats`."""
        return await self.call("GET", "/v1/stats", StatsOut, params={"consumer": consumer})

    async def health(self) -> HealthOut:
        """As `DataClient.health`."""
        return await self.call("GET", "/healthz", HealthOut)

    async def ready(self) -> ReadyOut:
        """As `DataClient.ready`."""
        return await self.call("GET", "/readyz", ReadyOut)
