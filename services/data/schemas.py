"""The data role's wire models: what its routes take and answer. No logic.

A body of `POST /v1/experience` is one `Group` (its wire form, `Group.to_json()`: what the rollout
role streams) or ``{"groups": [Group, ...]}``; every model refuses unknown fields.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from experience import Group, PolicyVersion

__all__ = [
    "BATCH_ID_PATTERN",
    "CONSUMER_PATTERN",
    "MAX_GROUPS",
    "AckOut",
    "AcksIn",
    "AcksOut",
    "AdmissionOut",
    "ErrorOut",
    "ExperienceIn",
    "ExperienceOut",
    "GroupsIn",
    "PolicyIn",
    "PolicyOut",
    "RegenerationsOut",
    "ReleaseOut",
    "StatsOut",
]

MAX_GROUPS = 1024
MAX_ACKS = 4096  # a step's micro-batches on one rank, with room to spare
BATCH_ID_PATTERN = r"^[A-Za-z0-9_-]{1,128}$"
CONSUMER_PATTERN = r"^[A-Za-z0-9._-]{1,64}$"
MAX_POLICY_VERSION = 2**53 - 1  # exact in every JSON reader (a double)


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


class ErrorDetail(_Wire):
    code: str = Field(description="stable: invalid_request, malformed_json, not_found, lease_expired, …")
    message: str
    item: int | None = Field(None, description="the index of the offending group in the body")
    field: str | None = Field(None, description="the offending field, dotted (batch.groups.1.prompt_ids)")


class ErrorOut(_Wire):
    """Every refusal's body (services.errors)."""

    error: ErrorDetail


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
