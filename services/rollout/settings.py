"""Settings of the rollout role: ``WEIR_*`` variables, checked when built (a bad value names its variable).

Code is chosen here and only here: ``WEIR_REWARD_FUNCTIONS`` and ``WEIR_ROLLOUT_FUNCTION`` are
imported and checked at construction, so a spec that does not import stops the role at start-up
instead of failing its first request.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import NoDecode

from rollout.group import DEFAULT_ROLLOUT_FUNCTION
from rollout.plugins import check_name, load_callable, load_coroutine_function, parse_named_specs
from rollout.rewards import BUILTIN_REWARDS

from ..roles import ROLES
from ..settings import ModelFolder, RoleSettings, ServedModelNames, served_or_own

__all__ = ["LEGACY_MODEL_ID", "RolloutSettings"]

_URL = r"^https?://[^\s/?#]+(?:/[^\s?#]*)?$"
# The id /v1/models gave whatever model was served, before it gave the model's own name: clients written
# against it (`model="weir-tiny-omni"`) keep working, but it is no name of the model, so it is not listed.
LEGACY_MODEL_ID = "weir-tiny-omni"


class RolloutSettings(RoleSettings):
    """Every field is ``WEIR_<NAME>``; defaults serve the embedded (laptop) mode."""

    model: ModelFolder = Field(
        Path(".weir/model"),
        description="the model folder the tokenizer, chat template and context length come from "
        "(must hold config.json; `weir init-model DIR` writes the embedded one)",
    )
    served_model_name: ServedModelNames = Field(
        [],
        description="the names the OpenAI routes serve the model under, comma-separated (vLLM's several names, "
        "SGLang's one): GET /v1/models lists each, a request may name any, every answer reports the first "
        "(default: the model's own name, its folder's name or owner/name for a hub id); requests naming "
        f"{LEGACY_MODEL_ID}, Weir's old fixed id, are served too (it is not listed)",
    )
    engine_urls: Annotated[list[str], NoDecode] = Field(
        [f"http://127.0.0.1:{ROLES['engine'].port}"],
        min_length=1,
        description="comma-separated engine URLs: Weir engine roles (http://host:port), or plain SGLang "
        "servers as sglang+http://host:port (media sent inline)",
    )
    preprocess_url: str = Field(
        f"http://127.0.0.1:{ROLES['preprocess'].port}", pattern=_URL, description="the preprocess role"
    )
    encoder_url: str | None = Field(
        None,
        description="the encoder role: media reach Weir engines as cached embeddings (one tower forward per "
        "unique item per weights version); empty: engines run the towers themselves, per sample",
    )
    data_url: str | None = Field(
        None, description="the data role: finished groups are appended there; empty: to experience_path"
    )
    experience_path: Path = Field(
        Path(".weir/experience.jsonl"), description="the JSONL file finished groups go to when there is no data role"
    )
    return_routed_experts: bool = Field(
        False, description="ask engines for the experts each token was routed to (MoE models; SGLang's R3)"
    )
    request_timeout_s: float = Field(
        300.0, gt=0, le=86_400, description="the longest any call to another role (one engine call) may take"
    )
    health_timeout_s: float = Field(2.0, gt=0, le=60, description="the engine health probe of /readyz")
    reward_timeout_s: float = Field(30.0, gt=0, le=3600, description="the longest one sample's reward may take")
    spool_dir: Path | None = Field(
        None,
        description="with a data role: acknowledge a recorded group once it is fsync'd in this folder (on the rollout "
        "role's own disk) and ship it to the data role behind the answer, saving a round trip per rollout; "
        "groups left there by a crash go out at the next start. Empty: the data role stores each group before "
        "the rollout is answered",
    )
    spool_backlog: int = Field(
        1024, gt=0, le=1_000_000, description="groups the spool holds for the data role before appends wait"
    )
    sink_retry_s: float = Field(
        60.0, ge=0, le=3600, description="how long a group is retried on a data role that does not answer"
    )
    engine_cooldown_s: float = Field(5.0, ge=0, le=3600, description="how long a failed engine sits out")
    max_per_engine: int = Field(
        64, gt=0, le=100_000, description="outstanding requests per engine before a group's affinity yields"
    )
    max_n: int = Field(64, gt=0, le=4096, description="the most samples per prompt (n)")
    max_prompts: int = Field(1024, gt=0, le=100_000, description="the most prompts per rollout request")
    max_inflight_media_tokens: int = Field(
        1_000_000, gt=0, description="media tokens (× n) in flight across requests; over it: 429 overloaded"
    )
    max_inflight_bytes: int = Field(
        1 << 30, gt=0, description="request bytes in flight across requests; over it: 429 overloaded"
    )
    default_max_tokens: int = Field(
        256,
        gt=0,
        le=1 << 20,
        description="max_new_tokens when a rollout request gives none (chat: all the context leaves)",
    )
    reward_functions: Annotated[dict[str, str], NoDecode] = Field(
        {},
        description="custom reward functions a request may name, comma-separated name=package.module:function "
        "(each called as function(response: str, reference: str | None, sample: Mapping) -> float); "
        "installed entry points of the group 'weir.rewards' are registered too",
    )
    partial_rollouts: Literal["keep", "drop"] = Field(
        "keep",
        description="a sample a pause cut short (a weight update with the engines paused in abort mode): keep "
        "its tokens and continue it under the new weights, each token tagged with the version that made it "
        "(keep), or let it end aborted (drop); a client's abort is never continued",
    )
    tools: Annotated[dict[str, str], NoDecode] = Field(
        {},
        description="tools a multi-turn request may name besides the built-ins (calculator, crop), comma-separated "
        "name=package.module:function (each called as function(arguments: dict, context: rollout.tools.ToolContext) "
        "-> text | image); installed entry points of the group 'weir.tools' are registered too",
    )
    environments: Annotated[dict[str, str], NoDecode] = Field(
        {},
        description="environments a multi-turn request may name besides the built-in visual_search, "
        "comma-separated name=package.module:Class (see rollout.environments)",
    )
    http_environments: Annotated[dict[str, str], NoDecode] = Field(
        {},
        description="environments served elsewhere, comma-separated name=http(s)://host:port[/path]: the only "
        "URLs an environment is ever reached at (a request names the environment, never a URL)",
    )
    tool_timeout_s: float = Field(
        10.0, gt=0, le=3600, description="the longest one tool call (or an environment's reset / step) may take"
    )
    tool_workers: int = Field(
        8,
        gt=0,
        le=1024,
        description="worker processes that run tools, built-in and registered (started on first use, kept warm; "
        "calls beyond them wait, and the wait counts toward their deadline)",
    )
    tool_cpu_s: int = Field(
        10, ge=1, le=3600, description="CPU seconds one tool call may use (its worker is killed past them)"
    )
    tool_memory_mib: int = Field(
        8192,
        ge=64,
        le=1 << 20,
        description="address space of one tool worker process, MiB (a tool's allocation beyond it fails: "
        "its call ends its trajectory, the role is untouched); mind that importing torch takes ~4 GiB",
    )
    rollout_function: str = Field(
        DEFAULT_ROLLOUT_FUNCTION,
        description="package.module:function run for each prompt of POST /v1/rollouts: "
        "async def f(ctx: rollout.RolloutContext, prompt: rollout.PromptSpec, /, *, index: int, "
        "sampling: engines.SamplingParams, budget: preprocess.TokenBudget | None) -> experience.Group",
    )

    @model_validator(mode="after")
    def _served_name_default(self) -> RolloutSettings:
        self.served_model_name = served_or_own(self.served_model_name, self.model)
        return self

    @property
    def accepted_names(self) -> frozenset[str]:
        """Every name a request may give its model: the served names and `LEGACY_MODEL_ID`."""
        return frozenset((*self.served_model_name, LEGACY_MODEL_ID))

    @field_validator("engine_urls", mode="before")
    @classmethod
    def _split_urls(cls, value: object) -> object:
        return [u.strip() for u in value.split(",") if u.strip()] if isinstance(value, str) else value

    @field_validator("engine_urls")
    @classmethod
    def _engine_urls(cls, value: list[str]) -> list[str]:
        for url in value:
            if not re.match(_URL, url.removeprefix("sglang+")):
                raise ValueError(f"WEIR_ENGINE_URLS: {url!r} is not http(s)://host:port or sglang+http(s)://host:port")
        return value

    @field_validator("encoder_url", "data_url", "spool_dir", mode="before")
    @classmethod
    def _empty_is_none(cls, value: object) -> object:
        return None if value == "" else value

    @field_validator("encoder_url", "data_url")
    @classmethod
    def _role_url(cls, value: str | None) -> str | None:
        if value is not None and not re.match(_URL, value):
            raise ValueError(f"{value!r} is not an http(s) URL")
        return value

    @field_validator("reward_functions", "tools", "environments", "http_environments", mode="before")
    @classmethod
    def _parse_named(cls, value: object, info: ValidationInfo) -> object:
        if isinstance(value, str):
            try:
                return parse_named_specs(value)
            except ValueError as error:
                raise ValueError(f"WEIR_{str(info.field_name).upper()}: {error}") from None
        return value

    @field_validator("reward_functions", "tools", "environments")
    @classmethod
    def _plugins_import(cls, value: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        """Every named function or class imports now, at start-up (never when a request names it)."""
        for name, spec in value.items():
            try:
                check_name(name)
                if info.field_name == "reward_functions" and name in (*BUILTIN_REWARDS, "custom"):
                    raise ValueError(f"{name!r} is a built-in reward type; give the function another name")
                load_callable(spec)
            except ValueError as error:
                raise ValueError(f"WEIR_{str(info.field_name).upper()}: {error}") from None
        return value

    @field_validator("http_environments")
    @classmethod
    def _environment_urls(cls, value: dict[str, str]) -> dict[str, str]:
        for name, url in value.items():
            try:
                check_name(name)
            except ValueError as error:
                raise ValueError(f"WEIR_HTTP_ENVIRONMENTS: {error}") from None
            if not re.match(_URL, url):
                raise ValueError(f"WEIR_HTTP_ENVIRONMENTS: {name}: {url!r} is not an http(s) URL")
        return value

    @field_validator("rollout_function")
    @classmethod
    def _rollout_function_imports(cls, value: str) -> str:
        try:
            load_coroutine_function(value)
        except ValueError as error:
            raise ValueError(f"WEIR_ROLLOUT_FUNCTION: {error}") from None
        return value
