"""What the rollout role sets up and checks around the `rollout` library: its context (clients that
carry the token and the request id to the other roles, the reward registry, admission, the sink),
its metrics, and the request-level checks that come before any work. No routes here (`app.py`)."""

from __future__ import annotations

from typing import Any

from experience.records import Group, SampleStatus
from rollout.admission import Admission
from rollout.dispatch import Dispatcher
from rollout.group import RolloutContext
from rollout.prompts import PromptBuilder
from rollout.rewards import RewardRegistry
from rollout.rewards import RewardSpec as LibraryRewardSpec
from rollout.sink import HttpSink, JsonlSink, Sink

from ..http import async_client
from ..metrics import RoleMetrics
from .schemas import UNSUPPORTED_CHAT_PARAMETERS, ChatRequest, RewardSpec, RolloutPrompt, RolloutRequest
from .settings import RolloutSettings

__all__ = ["RolloutMetrics", "build_context", "library_reward", "prompt_sampling", "unsupported_parameter"]


class RolloutMetrics:
    """The role's own figures (requests and latency by route come from the template)."""

    def __init__(self, metrics: RoleMetrics, admission: Admission) -> None:
        self.groups = metrics.counter("weir_rollout_groups", "Groups finished")
        self.samples = metrics.counter("weir_rollout_samples", "Samples finished, by status", ["status"])
        for status in SampleStatus:
            self.samples.labels(status.value)
        # A histogram, not a counter: a custom reward may be negative, and a counter cannot go down. Its
        # _sum is the reward sum of ok samples, its _count how many were rewarded. (Negative buckets
        # would make prometheus_client drop the _sum: a negative reward counts in le="0.0".)
        self.rewards = metrics.histogram(
            "weir_rollout_reward", "Rewards of ok samples", buckets=(0.0, 0.25, 0.5, 0.75, 1.0)
        )
        self.group_seconds = metrics.histogram("weir_rollout_group_seconds", "Time to roll out one group")
        inflight = metrics.gauge("weir_rollout_inflight_media_tokens", "Media tokens (x n) admitted and not finished")
        inflight.set_function(lambda: admission.media_tokens)
        inflight_bytes = metrics.gauge("weir_rollout_inflight_bytes", "Request bytes admitted and not finished")
        inflight_bytes.set_function(lambda: admission.bytes)

    def finished(self, group: Group, seconds: float) -> None:
        self.groups.inc()
        self.group_seconds.observe(seconds)
        for sample in group.samples:
            self.samples.labels(sample.status.value).inc()
            if sample.status is SampleStatus.OK and sample.reward is not None:
                self.rewards.observe(sample.reward)


def build_context(settings: RolloutSettings) -> tuple[RolloutContext, list[Any]]:
    """The rollout context for ``settings``, and the HTTP clients to close with the app."""
    token, timeout = settings.token, settings.request_timeout_s
    engines = async_client(token=token, timeout=timeout)
    preprocess = async_client(settings.preprocess_url, token=token, timeout=timeout)
    encoder = async_client(settings.encoder_url, token=token, timeout=timeout) if settings.encoder_url else None
    clients: list[Any] = [engines, preprocess, *([encoder] if encoder is not None else [])]
    sink: Sink
    if settings.data_url:
        data = async_client(settings.data_url, token=token, timeout=timeout)
        clients.append(data)
        sink = HttpSink(data, retry_s=settings.sink_retry_s)
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
    )
    return context, clients


def library_reward(spec: RewardSpec) -> LibraryRewardSpec:
    return LibraryRewardSpec(type=spec.type, answer=spec.answer, function=spec.function)


def prompt_sampling(request: RolloutRequest, prompt: RolloutPrompt, default_max_tokens: int) -> dict[str, Any]:
    sampling = {**request.sampling_params, **(prompt.sampling_params or {})}
    if sampling.get("max_new_tokens") is None:  # absent or null: the role's default, not SGLang's
        sampling["max_new_tokens"] = default_max_tokens
    return sampling


def unsupported_parameter(body: ChatRequest) -> str | None:
    """The first OpenAI field set to something this role would otherwise silently ignore."""
    neutral: dict[str, tuple[Any, ...]] = {
        "frequency_penalty": (0, 0.0),
        "presence_penalty": (0, 0.0),
        "top_logprobs": (0,),
        "logit_bias": ({},),
        "modalities": (["text"],),
        "response_format": ({"type": "text"},),
        "tools": ([],),
        "functions": ([],),
        "tool_choice": ("none",),
    }
    for name in UNSUPPORTED_CHAT_PARAMETERS:
        value = getattr(body, name)
        if value is not None and not any(value == n and type(value) is type(n) for n in neutral.get(name, ())):
            return name
    return None
