"""What the rollout role sets up and checks around the `rollout` library: its context (clients that
carry the token and the request id to the other roles, the reward registry, admission, the sink),
its metrics, the state its routes share, and the request-level checks that come before any work. No
routes here (the route modules: `rollouts`, `chat`, `completions`, `models`, `rewards`)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

from pydantic import JsonValue

from encoders.client import AsyncEncoderClient
from engines.errors import InvalidSampling
from engines.protocol import SamplingParams
from engines.sampling import SUPPORTED_SAMPLING, sampling_from
from experience.client import AsyncDataClient
from experience.records import Group, SampleStatus
from preprocess.budget import TokenBudget
from preprocess.client import AsyncPreprocessClient
from rollout.admission import Admission
from rollout.api import (
    EXTENSION_REFUSALS,
    UNSUPPORTED_CHAT_PARAMETERS,
    ChatRequest,
    CompletionRequest,
    NamedToolChoice,
    RolloutPrompt,
    RolloutRequest,
)
from rollout.context import RolloutContext, RolloutFunction
from rollout.dispatch import Dispatcher
from rollout.environments import EnvironmentRef, EnvironmentRegistry
from rollout.logprobs import LogprobAsk
from rollout.messages import FunctionTool, function_tool
from rollout.prompts import RESERVED_TEMPLATE_VARIABLES, PromptBuilder
from rollout.rewards import RewardRegistry
from rollout.sink import HttpSink, JsonlSink, Sink
from rollout.spool import SpooledSink
from rollout.tools import Tool, ToolRegistry

from ..errors import ApiError
from ..http import async_client
from ..metrics import RoleMetrics
from .settings import RolloutSettings

__all__ = [
    "ANY_JSON_OBJECT",
    "ENGINE_SAMPLING_FIELDS",
    "EXTENSION_SAMPLING",
    "MultiturnFields",
    "RolloutMetrics",
    "RolloutRole",
    "build_context",
    "build_plugins",
    "budget_of",
    "chat_logprobs",
    "chat_sampling",
    "completion_logprobs",
    "completion_refusal",
    "extension_refusal",
    "multiturn_fields",
    "prompt_sampling",
    "response_format_sampling",
    "template_variables",
    "tool_prompt",
    "unsupported_parameter",
]


class RolloutMetrics:
    """The role's own figures (requests and latency by route come from the template)."""

    def __init__(self, metrics: RoleMetrics, admission: Admission) -> None:
        self.groups = metrics.counter("weir_rollout_groups", "Groups finished (evaluations included)")
        # What the data role must account for: stored, or dropped with a reason (`record: false` groups never
        # reach it, so the finished count alone overstates what went there).
        self.recorded = metrics.counter("weir_rollout_groups_recorded", "Groups finished and appended to the sink")
        self.samples = metrics.counter("weir_rollout_samples", "Samples finished, by status", ["status"])
        for status in SampleStatus:
            self.samples.labels(status.value)
        # A histogram, not a counter: a custom reward may be negative, and a counter cannot go down. Its
        # _sum is the reward sum of ok samples, its _count how many were rewarded. (Negative buckets
        # would make prometheus_client drop the _sum: a negative reward counts in le="0.0".)
        self.rewards = metrics.histogram(
            "weir_rollout_reward", "Rewards of ok samples", buckets=(0.0, 0.25, 0.5, 0.75, 1.0)
        )
        self.continuations = metrics.counter(
            "weir_rollout_continuations", "Continuations of samples a pause cut short (partial rollouts)"
        )
        self.kept_tokens = metrics.counter(
            "weir_rollout_kept_tokens", "Tokens kept at continuations instead of generated again (partial rollouts)"
        )
        self.group_seconds = metrics.histogram("weir_rollout_group_seconds", "Time to roll out one group")
        inflight = metrics.gauge("weir_rollout_inflight_media_tokens", "Media tokens (x n) admitted and not finished")
        inflight.set_function(lambda: admission.media_tokens)
        inflight_bytes = metrics.gauge("weir_rollout_inflight_bytes", "Request bytes admitted and not finished")
        inflight_bytes.set_function(lambda: admission.bytes)

    def watch_spool(self, metrics: RoleMetrics, spool: SpooledSink) -> None:
        """The spool's figures: what waits for the data role, and what it took or refused since start."""
        figures: list[tuple[str, str, Callable[[], float]]] = [
            ("weir_rollout_spool_backlog", "Groups spooled and not yet taken by the data role", lambda: spool.backlog),
            ("weir_rollout_spool_shipped", "Groups the data role took from the spool", lambda: spool.shipped),
            ("weir_rollout_spool_refused", "Groups the data role refused (in refused.jsonl)", lambda: spool.refused),
        ]
        for name, help_text, read in figures:
            metrics.gauge(name, help_text).set_function(read)

    def finished(self, group: Group, seconds: float, *, recorded: bool) -> None:
        self.groups.inc()
        if recorded:
            self.recorded.inc()
        self.group_seconds.observe(seconds)
        for sample in group.samples:
            self.samples.labels(sample.status.value).inc()
            self.continuations.inc(sample.timings.get("continuations", 0.0))
            self.kept_tokens.inc(sample.timings.get("kept_tokens", 0.0))
            if sample.status is SampleStatus.OK and sample.reward is not None:
                self.rewards.observe(sample.reward)


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutRole:
    """What the routes share (``app.state.rollout``; routes take it through `deps.RolloutRoleDep`). The context is
    also ``app.state.weir``, as every role's library state is."""

    settings: RolloutSettings
    context: RolloutContext
    function: RolloutFunction  # the rollout function named by WEIR_ROLLOUT_FUNCTION
    tools: ToolRegistry
    environments: EnvironmentRegistry
    figures: RolloutMetrics


def build_context(settings: RolloutSettings) -> tuple[RolloutContext, list[Any]]:
    """The rollout context for ``settings``, and the HTTP clients to close with the app."""
    token, timeout = settings.token, settings.request_timeout_s
    # Unbounded: the engines run one request per sample being generated, and the role bounds that itself
    # (max_per_engine per engine, admission); a pool of 100 would cap every engine together at 100 samples.
    # No connection retries to engines: the dispatcher fails over to another engine at once, and its health
    # probes (`/readyz`) must see a dead engine as dead (a retry would hold each for ~30 s). With one engine, a
    # sample sent while it restarts fails (503 engines_unavailable) and `weir train` drops that prompt.
    engines = async_client(token=token, timeout=timeout, max_connections=None, connect_retry_s=0)
    # The request-id hook and connection retries are `async_client`'s; each role's client shares its pool.
    to_preprocess = async_client(settings.preprocess_url, token=token, timeout=timeout)
    preprocess = AsyncPreprocessClient(settings.preprocess_url, token=token, timeout_s=timeout, http=to_preprocess)
    clients: list[Any] = [engines, to_preprocess]
    encoder = None
    if settings.encoder_url:
        to_encoder = async_client(settings.encoder_url, token=token, timeout=timeout)
        encoder = AsyncEncoderClient(settings.encoder_url, token=token, timeout_s=timeout, http=to_encoder)
        clients.append(to_encoder)
    sink: Sink
    if settings.data_url:
        data = async_client(settings.data_url, token=token, timeout=timeout)
        clients.append(data)
        # The request-id hook and connection retries are `async_client`'s; the data client shares its pool.
        store = AsyncDataClient(
            settings.data_url, token=token, timeout_s=timeout, retry_s=settings.sink_retry_s, http=data
        )
        if settings.spool_dir is None:
            sink = HttpSink(store, retry_s=settings.sink_retry_s)
        else:
            sink = SpooledSink(
                store, settings.spool_dir, max_backlog=settings.spool_backlog, retry_s=settings.sink_retry_s
            )
    else:
        sink = JsonlSink(settings.experience_path)
    context = RolloutContext(
        prompts=PromptBuilder(settings.model),
        dispatcher=Dispatcher(
            settings.engine_urls,
            timeout_s=timeout,
            client=engines,
            max_per_engine=settings.max_per_engine,
            cooldown_s=settings.engine_cooldown_s,
        ),
        preprocess=preprocess,
        encoder=encoder,
        sink=sink,
        rewards=RewardRegistry.load(settings.reward_functions),
        admission=Admission(max_media_tokens=settings.max_inflight_media_tokens, max_bytes=settings.max_inflight_bytes),
        default_max_tokens=settings.default_max_tokens,
        return_routed_experts=settings.return_routed_experts,
        reward_timeout_s=settings.reward_timeout_s,
        partial_rollouts=settings.partial_rollouts,
    )
    return context, clients


def build_plugins(settings: RolloutSettings) -> tuple[ToolRegistry, EnvironmentRegistry]:
    """The tools and environments a multi-turn request may name, built once at start-up."""
    tools = ToolRegistry.load(
        settings.tools,
        timeout_s=settings.tool_timeout_s,
        workers=settings.tool_workers,
        cpu_s=settings.tool_cpu_s,
        memory_mib=settings.tool_memory_mib,
    )
    environments = EnvironmentRegistry.load(
        settings.environments, settings.http_environments, timeout_s=settings.tool_timeout_s
    )
    return tools, environments


class MultiturnFields(TypedDict):
    """The multi-turn fields of a `rollout.context.PromptSpec`, resolved."""

    tools: Sequence[Tool]
    environment: EnvironmentRef | None
    max_turns: int | None


def multiturn_fields(
    prompt: RolloutPrompt, index: int, tools: ToolRegistry, environments: EnvironmentRegistry
) -> MultiturnFields:
    """A prompt's ``tools`` / ``environment`` / ``max_turns`` resolved against the registries (400
    ``unknown_tool`` naming the first unknown name) as `PromptSpec` fields; the environment's own
    registered tools are offered too."""
    where = f"prompts[{index}]"
    names = list(prompt.tools or [])
    environment = None
    if prompt.environment is not None:
        environment = environments.resolve(prompt.environment.name, prompt.environment.options, f"{where}.environment")
        names += [n for n in environments.tools_of(prompt.environment.name) if n not in names]
    return MultiturnFields(
        tools=tools.resolve(names, f"{where}.tools"), environment=environment, max_turns=prompt.max_turns
    )


def prompt_sampling(request: RolloutRequest, prompt: RolloutPrompt, default_max_tokens: int) -> SamplingParams:
    """A prompt's `SamplingParams`: the request's ``sampling_params`` overridden key by key by the prompt's
    own, ``max_new_tokens`` the role's default when absent or null (not SGLang's); `InvalidSampling`
    (400) naming the field otherwise."""
    sampling = {**request.sampling_params, **(prompt.sampling_params or {})}
    if sampling.get("max_new_tokens") is None:
        sampling["max_new_tokens"] = default_max_tokens
    return sampling_from(sampling)


def budget_of(request: RolloutRequest) -> TokenBudget | None:
    """The request's preprocess `TokenBudget` (None: the preprocess role's default); a field not given is
    not sent (`TokenBudget.to_wire`), so the preprocess role's default applies to it."""
    if request.budget is None:
        return None
    given = request.budget.model_dump(exclude_none=True)
    return TokenBudget(**{"policy": None, **given})  # no policy named: the preprocess role's own


# OpenAI fields that are SGLang sampling keys of the same name and meaning: passed on when the engines
# implement them (engines.sampling.SUPPORTED_SAMPLING), refused by name otherwise.
ENGINE_SAMPLING_FIELDS = ("frequency_penalty", "presence_penalty", "logit_bias")


def unsupported_parameter(body: ChatRequest) -> str | None:
    """The first OpenAI field set to something this role would otherwise silently ignore."""
    neutral: dict[str, tuple[Any, ...]] = {
        "frequency_penalty": (0, 0.0),
        "presence_penalty": (0, 0.0),
        "logit_bias": ({},),
        "modalities": (["text"],),
        "functions": ([],),
    }
    for name in UNSUPPORTED_CHAT_PARAMETERS:
        value = getattr(body, name)
        if value is None or any(value == n and type(value) is type(n) for n in neutral.get(name, ())):
            continue
        if name in ENGINE_SAMPLING_FIELDS and name in SUPPORTED_SAMPLING:
            continue
        return name
    return None


def completion_refusal(body: CompletionRequest) -> tuple[str, str] | None:
    """(field, why) of the first ``/v1/completions`` field this role would otherwise silently ignore."""
    for name in ENGINE_SAMPLING_FIELDS:
        value = getattr(body, name)
        if value is not None and value not in (0, 0.0, {}) and name not in SUPPORTED_SAMPLING:
            return name, UNSUPPORTED_CHAT_PARAMETERS[name]
    if body.suffix is not None and body.suffix != "":
        return "suffix", "insertion (suffix) is not supported"
    if body.best_of is not None and body.best_of != 1:
        return "best_of", "best_of is not supported (ask for n choices)"
    if body.stream and not isinstance(body.prompt, str) and body.prompt and not isinstance(body.prompt[0], int):
        return "stream", "a batch of prompts is not streamed: one prompt per streamed request"
    return None


# SGLang's and vLLM's request fields (`schemas.EngineExtensions`) → the SGLang sampling key each is.
EXTENSION_SAMPLING = {
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_new_tokens",
    "stop_token_ids": "stop_token_ids",
    "skip_special_tokens": "skip_special_tokens",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
    "no_stop_trim": "no_stop_trim",
    "regex": "regex",
    "ebnf": "ebnf",
}
_REQUEST_FIELD = {key: name for name, key in EXTENSION_SAMPLING.items()} | {"sampling_seed": "seed"}


def extension_refusal(body: ChatRequest | CompletionRequest) -> ApiError | None:
    """The 400 for the first field of ``body`` its schema does not declare: ``unsupported_parameter`` for
    an SGLang / vLLM field this role does not implement (`EXTENSION_REFUSALS`, saying what to use),
    ``unknown_parameter`` for any other. None when there is none: no field is silently ignored."""
    name = next(iter(body.model_extra or {}), None)
    if name is None:
        return None
    if name in EXTENSION_REFUSALS:
        return ApiError(400, "unsupported_parameter", f"{name}: {EXTENSION_REFUSALS[name]}", field=name)
    return ApiError(
        400,
        "unknown_parameter",
        f"{name}: not a field of this API (OpenAI's, with the SGLang and vLLM extensions listed in the "
        "OpenAPI document)",
        field=name,
    )


def template_variables(body: ChatRequest) -> dict[str, JsonValue] | None:
    """``chat_template_kwargs``, for the chat template; a name the template is already rendered with
    (`rollout.prompts.RESERVED_TEMPLATE_VARIABLES`) is 400 ``invalid_chat_template_kwargs`` naming it."""
    variables = body.chat_template_kwargs
    reserved = sorted(set(variables or {}) & RESERVED_TEMPLATE_VARIABLES)
    if reserved:
        raise ApiError(
            400,
            "invalid_chat_template_kwargs",
            f"chat_template_kwargs.{reserved[0]}: set by this role, not by a request",
            field="chat_template_kwargs",
        )
    return variables


def chat_sampling(
    body: ChatRequest | CompletionRequest, *, max_new_tokens: int, json_schema: str | None = None
) -> SamplingParams:
    """The `SamplingParams` of an OpenAI request (checked by `unsupported_parameter` first), read as
    SGLang's ``sampling_params`` would be (a 400 with `InvalidSampling`'s code, naming the request's
    field); a ``seed`` becomes ``sampling_seed``, which gives each choice its own seed; SGLang's and
    vLLM's fields their SGLang keys (`EXTENSION_SAMPLING`; a ``top_k`` of 0 is -1, all, as vLLM);
    ``json_schema``: the grammar of its ``response_format`` (`response_format_sampling`).
    ``max_new_tokens``: the request's bound (the caller sets the exact one per prompt)."""
    sampling: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "json_schema": json_schema,
    }
    if body.stop is not None:
        sampling["stop"] = [body.stop] if isinstance(body.stop, str) else body.stop
    if body.seed is not None:
        sampling["sampling_seed"] = body.seed
    if body.ignore_eos:
        sampling["ignore_eos"] = True
    for name in ENGINE_SAMPLING_FIELDS:
        value = getattr(body, name)
        if value is not None and name in SUPPORTED_SAMPLING:
            sampling[name] = value
    for name, key in EXTENSION_SAMPLING.items():
        value = getattr(body, name)
        if value is not None:
            sampling[key] = value
    if sampling.get("top_k") == 0:
        sampling["top_k"] = -1
    try:
        return sampling_from(sampling)
    except InvalidSampling as error:  # named as the request names it (SGLang's keys are the engines')
        key = (error.field or "").removeprefix("sampling_params.")
        field = _REQUEST_FIELD.get(key, key) or None
        raise ApiError(400, error.code, f"{field}: {error}" if field else str(error), field=field) from None


def chat_logprobs(body: ChatRequest) -> LogprobAsk:
    """What a chat request asks the engines for beyond the sampled tokens' log-probs: ``top_logprobs``
    alternatives, which (as OpenAI) need ``logprobs: true`` (400 ``invalid_top_logprobs`` without)."""
    top = body.top_logprobs or 0
    if top and not body.logprobs:
        raise ApiError(
            400, "invalid_top_logprobs", "top_logprobs: logprobs must be true to use top_logprobs", field="top_logprobs"
        )
    return LogprobAsk(top=top if body.logprobs else 0)


def completion_logprobs(body: CompletionRequest) -> LogprobAsk:
    """A text completion's ``logprobs: k``: the k most likely alternatives, and with ``echo`` the prompt's
    own log-probs (from its first token)."""
    if body.logprobs is None:
        return LogprobAsk()
    return LogprobAsk(top=body.logprobs, prompt=body.echo)


ANY_JSON_OBJECT = "$$ANY$$"
"""SGLang's ``json_schema`` that admits any JSON object (its own OpenAI server's ``json_object``)."""


def response_format_sampling(body: ChatRequest, *, prefill: str = "") -> dict[str, str]:
    """SGLang sampling keys for ``response_format``: none for ``text``; ``json_schema`` (constrained
    decoding) for ``json_object`` (any object) and ``json_schema`` (its schema, as JSON text). Another
    type, a ``json_schema`` without a schema, or JSON asked for an answer forced to start with a tool call
    (``prefill``) is 400 naming ``response_format``."""
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return {}

    def refuse(why: str, code: str = "invalid_response_format") -> ApiError:
        return ApiError(400, code, f"response_format: {why}", field="response_format")

    if fmt.type not in ("json_object", "json_schema"):
        raise refuse(
            f"type {fmt.type!r} is not supported (text, json_object or json_schema)", code="unsupported_parameter"
        )
    if prefill:
        raise refuse("a JSON answer cannot also be forced to start with a tool call (tool_choice required or named)")
    if fmt.type == "json_object":
        return {"json_schema": ANY_JSON_OBJECT}
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise refuse("type json_schema needs json_schema: {name, schema}, with the schema the answer must follow")
    return {"json_schema": json.dumps(fmt.json_schema.schema_)}


def tool_prompt(body: ChatRequest) -> tuple[list[FunctionTool] | None, str]:
    """(the tools to render, the text the answer is forced to start with) for a chat request:
    ``tool_choice`` none leaves the tools out; required starts the answer with a ``<tool_call>`` block,
    a named function with a block calling it (no constrained decoding: the model writes the rest)."""
    if not body.tools:
        if body.tool_choice is not None and body.tool_choice != "none":
            raise ApiError(
                400, "invalid_tool_choice", "tool_choice: only allowed when tools are given", field="tool_choice"
            )
        return None, ""
    if body.tool_choice == "none":
        return None, ""
    tools = [  # what the client left null is left out, as if it had not sent it
        function_tool(
            f["name"], description=f.get("description"), parameters=f.get("parameters"), strict=f.get("strict")
        )
        for f in (t["function"] for t in body.tools)
    ]
    choice = body.tool_choice
    if isinstance(choice, NamedToolChoice):
        names = [t["function"]["name"] for t in body.tools]
        if choice.function.name not in names:
            raise ApiError(
                400,
                "invalid_tool_choice",
                f"tool_choice.function.name: {choice.function.name!r} is not one of the tools {names}",
                field="tool_choice",
            )
        return tools, '<tool_call>\n{"name": "' + choice.function.name + '", "arguments": '
    if choice == "required":
        return tools, '<tool_call>\n{"name": "'
    return tools, ""
