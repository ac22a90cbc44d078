"""The experience library: typed rollout records and the durable store behind the data role (no HTTP)."""

from __future__ import annotations

from .records import (
    GROUP_ADAPTER,
    MICROBATCH_SCHEMA,
    Group,
    PolicyVersion,
    Sample,
    SampleStatus,
    policy_version_of,
    sample_id,
)

__all__ = [
    "GROUP_ADAPTER",
    "MICROBATCH_SCHEMA",
    "Group",
    "PolicyVersion",
    "Sample",
    "SampleStatus",
    "policy_version_of",
    "sample_id",
]
