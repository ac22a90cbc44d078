"""The data role's wire records: what its routes take and answer — declared once, here. No logic.

The role (`services.data`) validates with these and every caller builds and reads them (`experience.client`).
A body of `POST /v1/experience` is one `Group` (its wire form, `Group.to_json()`: what the rollout role
streams) or ``{"groups": [Group, ...]}``; every model refuses unknown fields. A micro-batch is not JSON: it is
an Arrow IPC stream (`MicroBatchDelivery`, its rows in `experience.records.MICROBATCH_SCHEMA`). An error body
is the server framework's (``{"error": {...}}``, `services.errors`), not a record of this role.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from .records import BatchMeta, Group, PolicyVersion

__all__ = [
    "BATCH_ID_HEADER",
    "BATCH_ID_PATTERN",
    "CONSUMER_PATTERN",
    "MAX_ACKS",
    "MAX_GROUPS",
    "MAX_POLICY_VERSION",
    "AckOut",
    "AcksIn",
    "AcksOut",
    "AdmissionOut",
    "ExperienceIn",
    "ExperienceOut",
    "GroupsIn",
    "HealthOut",
    "MicroBatchDelivery",
    "PolicyIn",
    "PolicyOut",
    "ReadyOut",
    "RegenerationsOut",
    "ReleaseOut",
    "StatsOut",
]

MAX_GROUPS = 1024
MAX_ACKS = 4096  # a step's micro-batches on one rank, with room to spare
BATCH_ID_PATTERN = r"^[A-Za-z0-9_-]{1,128}$"
CONSUMER_PATTERN = r"^[A-Za-z0-9._-]{1,64}$"
MAX_POLICY_VERSION = 2**53 - 1  # exact in every JSON reader (a double)
BATCH_ID_HEADER = "X-Weir-Batch-Id"  # names a delivered micro-batch: the id to acknowledge


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GroupsIn(_Wire):
    groups: list[Group] = Field(min_length=1, max_length=MAX_GROUPS, description="finished groups, stored in order")


def _shape(body: Any) -> str:
    if isinstance(body, GroupsIn) or (isinstance(body, dict) and "groups" in body):
        return "batch"
    return "group"


ExperienceIn = Annotated[
    Annotated[Group, Tag("group")] | Annotated[GroupsIn, Tag("batch")],
    Discriminator(_shape),
]
"""One group, or ``{"groups": [...]}``; a validation error's field starts with ``group.`` or ``batch.``."""


class ExperienceOut(_Wire):
    stored: list[str] = Field(description="group ids stored now (a group dropped by the store's filters counts)")
    duplicates: list[str] = Field(description="group ids that were already stored: nothing changed")


class PolicyIn(_Wire):
    version: Annotated[PolicyVersion, Field(strict=True, le=MAX_POLICY_VERSION)] = Field(
        description="the trainer's new policy version (0 = the initial weights, +1 per publish)"
    )


class PolicyOut(_Wire):
    policy_version: int


class AckOut(_Wire):
    acked: str = Field(description="the acknowledged batch id")


class AcksIn(_Wire):
    batch_ids: list[Annotated[str, Field(pattern=BATCH_ID_PATTERN)]] = Field(
        min_length=1, max_length=MAX_ACKS, description="X-Weir-Batch-Id values of trained micro-batches (a step's)"
    )


class AcksOut(_Wire):
    acked: list[str] = Field(description="batch ids now recorded as trained (acknowledged now or before)")
    lease_expired: list[str] = Field(
        description="batch ids not acknowledged: their lease ran out and their samples went out again"
    )


class ReleaseOut(_Wire):
    released: int = Field(description="deliveries returned to the queue")


class RegenerationsOut(_Wire):
    groups: list[str] = Field(description="group ids whose prompts should be generated again; each handed out once")


class AdmissionOut(_Wire):
    groups: int = Field(description="how many more groups the producer may start now")
    policy_version: int


class StatsOut(_Wire):
    groups: int = Field(description="groups stored with at least one sample")
    samples: int = Field(description="samples stored")
    queue_samples: int = Field(description="samples waiting for the consumer")
    consumed: int = Field(description="samples the consumer acknowledged")
    bytes: int = Field(description="bytes of stored Arrow entries")
    policy_version: int
    staleness_histogram: dict[str, int] = Field(description="stored samples by versions behind the policy")
    drops: dict[str, int] = Field(description="groups and samples dropped, by counter name")
    microbatches_delivered: int = Field(description="micro-batches leased to any consumer (again after an expiry)")


class HealthOut(BaseModel):
    """``GET /healthz``: the process answers (the template's, every role alike)."""

    status: Literal["ok"]


class ReadyOut(BaseModel):
    """``GET /readyz`` of a ready data role (503 while its store cannot write)."""

    status: Literal["ready"]
    policy_version: int


@dataclass(frozen=True, slots=True)
class MicroBatchDelivery:
    """One answer of ``GET /v1/microbatches``: the batch id to acknowledge (the ``X-Weir-Batch-Id`` header), its
    rows (an Arrow table in `MICROBATCH_SCHEMA`, plus ``media`` when inline) and its schema metadata ``weir``.
    The envelope is checked when read (`experience.client`); the rows are Arrow's, read as they come."""

    batch_id: str
    table: pa.Table
    meta: BatchMeta
