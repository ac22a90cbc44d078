"""The records that carry a rollout from the engines to the trainer — defined once, here.

``Sample`` (one response) and ``Group`` (the ``n`` responses to one prompt) are what the rollout
produces, what the rollout role streams, what `POST /v1/experience` accepts and what the experience
store ingests; ``MICROBATCH_SCHEMA`` is the Arrow row schema of every micro-batch the data role
serves, the contract existing trainers code against. ``PolicyVersion`` is the one integer type of a
weights version everywhere.

They are pydantic dataclasses: frozen, slotted, keyword-only records that validate when built,
so a record read off the wire (``Group.from_json`` / ``GROUP_ADAPTER``) is exactly as trustworthy
as one built in process, and an unknown field is refused by name. This module holds no behaviour
beyond its own invariants: advantages live in `experience.advantages`, storage in
`experience.store`.
"""

from __future__ import annotations

import enum
import math
from typing import Annotated, Any, Literal

import pyarrow as pa
from pydantic import ConfigDict, Field, TypeAdapter, model_validator
from pydantic.dataclasses import dataclass

__all__ = [
    "GROUP_ADAPTER",
    "GROUP_ID_PATTERN",
    "MICROBATCH_SCHEMA",
    "FinishReason",
    "Group",
    "PolicyVersion",
    "Sample",
    "SampleStatus",
    "policy_version_of",
    "sample_id",
]

PolicyVersion = Annotated[int, Field(ge=0)]
"""A weights version: 0 for the initial weights, +1 for every publish. One integer everywhere."""

GROUP_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
"""Group ids are safe in paths and URLs and never contain ``/`` (the sample-id separator)."""

_RECORD = ConfigDict(extra="forbid", allow_inf_nan=False)


def sample_id(group_id: str, index: int) -> str:
    """The one spelling of a sample's id: ``{group_id}/{index}``."""
    return f"{group_id}/{index}"


def policy_version_of(weight_version: object) -> int:
    """The policy version an engine reports as its ``weight_version``.

    SGLang reports a string; Weir's publisher sets decimal integers, and a fresh SGLang server says
    ``"default"`` for the weights it started with (version 0). Anything else is an error, never 0.
    """
    if isinstance(weight_version, bool):
        raise ValueError(f"not a policy version: {weight_version!r}")
    if isinstance(weight_version, int) and weight_version >= 0:
        return weight_version
    if isinstance(weight_version, str):
        if weight_version == "default":
            return 0
        if weight_version.isascii() and weight_version.isdecimal():
            return int(weight_version)
    raise ValueError(f"the engine's weight_version {weight_version!r} is not a policy version (a decimal integer)")


class SampleStatus(enum.StrEnum):
    """How a sample ended. Only ``ok`` samples with a reward are trained on."""

    OK = "ok"  # generated (stop or length) and rewarded
    FAILED = "failed"  # no engine could generate it, or its reward raised: ``error`` says which
    ABORTED = "aborted"  # the engine aborted it (a weight update in abort mode, a client abort)


FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True, slots=True, kw_only=True, config=_RECORD)
class Sample:
    """One response to a prompt."""

    index: Annotated[int, Field(ge=0)]
    status: SampleStatus
    response_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list)  # one per response token, under the sampling policy
    text: str = ""
    reward: float | None = None
    finish_reason: FinishReason | None = None
    policy_version: PolicyVersion | None = None  # the weights that generated it; None if nothing was
    error: str | None = None  # why it failed
    routed_experts: str | None = None  # MoE routing as SGLang returns it (base64 int32), for replay
    timings: dict[str, float] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> Sample:
        if len(self.logprobs) != len(self.response_ids):
            raise ValueError(f"logprobs has {len(self.logprobs)} entries for {len(self.response_ids)} response tokens")
        if self.status is SampleStatus.OK and self.policy_version is None:
            raise ValueError("an ok sample needs the policy_version that generated it")
        if self.status is SampleStatus.FAILED and not self.error:
            raise ValueError("a failed sample needs an error")
        if self.reward is not None and not math.isfinite(self.reward):
            raise ValueError("reward must be finite")
        return self

    @property
    def trainable(self) -> bool:
        """An ok sample with a reward: what the experience store keeps."""
        return self.status is SampleStatus.OK and self.reward is not None


@dataclass(frozen=True, slots=True, kw_only=True, config=_RECORD)
class Group:
    """The ``n`` samples of one prompt: the unit of advantages, storage and idempotence."""

    group_id: Annotated[str, Field(pattern=GROUP_ID_PATTERN)]
    prompt_ids: list[Annotated[int, Field(ge=0)]] = Field(min_length=1)
    samples: list[Sample] = Field(min_length=1, max_length=4096)
    prompt_index: Annotated[int, Field(ge=0)] = 0  # the prompt's position in its request
    feature_keys: list[Annotated[str, Field(pattern=r"^[0-9a-f]{40}$")]] = Field(default_factory=list)
    token_counts: dict[str, Annotated[int, Field(ge=0)]] = Field(default_factory=dict)  # per modality, + "text"
    timings: dict[str, float] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _unique_indices(self) -> Group:
        indices = [s.index for s in self.samples]
        if len(set(indices)) != len(indices):
            raise ValueError("samples: every sample index must be unique within its group")
        return self

    def sample_id(self, sample: Sample) -> str:
        return sample_id(self.group_id, sample.index)

    def to_json(self) -> dict[str, Any]:
        """The wire form (what the rollout role streams and `POST /v1/experience` takes)."""
        return GROUP_ADAPTER.dump_python(self, mode="json")  # type: ignore[no-any-return]

    @classmethod
    def from_json(cls, payload: Any) -> Group:
        """Validated from its wire form; raises `pydantic.ValidationError` naming the field."""
        return GROUP_ADAPTER.validate_python(payload)


GROUP_ADAPTER: TypeAdapter[Group] = TypeAdapter(Group)


def _column(name: str, kind: pa.DataType, meaning: str) -> pa.Field:
    return pa.field(name, kind, nullable=False, metadata={"description": meaning})


MICROBATCH_SCHEMA = pa.schema(
    [
        _column("sample_id", pa.string(), "`{group_id}/{index}`: unique per sample, stable across redeliveries"),
        _column("group_id", pa.string(), "the prompt's group (advantages are relative within it)"),
        _column("input_ids", pa.list_(pa.int32()), "prompt ids (media placeholders expanded) then response ids"),
        _column("loss_mask", pa.list_(pa.int8()), "per token: 1 on tokens the policy generated, 0 elsewhere"),
        _column(
            "rollout_logprobs",
            pa.list_(pa.float32()),
            "per token: the engine's log-prob of the generated token (0 where loss_mask is 0)",
        ),
        _column("advantage", pa.float32(), "the sample's advantage (GRPO / Dr. GRPO), applied to each of its tokens"),
        _column("reward", pa.float32(), "the sample's reward"),
        _column("policy_version", pa.int64(), "the policy version that generated the response"),
        _column("feature_keys", pa.list_(pa.string()), "the prompt's media, in prompt order: feature-cache keys"),
    ],
    metadata={"weir.schema": "microbatch/1"},
)
"""One row per sequence. A batch's schema metadata ``weir`` holds ``batch_id``, ``rank``,
``consumer`` and the data role's ``policy_version``; with ``inline_media`` a ``media`` column
(``list<binary>``: each feature entry as Arrow IPC) follows."""
