"""The rollout library: prompts → engines → rewarded, typed `Group`s, with no HTTP server of its own.

The rollout role (`services.rollout`) builds a `RolloutContext` once and runs a rollout function
(`rollout_group` unless ``WEIR_ROLLOUT_FUNCTION`` names another) per prompt. Modules:

    prompts     OpenAI messages → preprocess items; chat template + exact placeholder expansion
    dispatch    engines: least outstanding, group affinity, one retry elsewhere, health probes
    group       the rollout itself: prepare → generate n (each seeded sample its own seed) → reward →
                `Group`; the context; chat samples, whole or streamed (with top / prompt log-probs)
    rewards     built-in rewards and the registry of custom ones (named, registered at start-up)
    admission   bounds on in-flight media tokens and request bytes
    chat        OpenAI chat / text-completion shaping: objects, streamed deltas, tool calls
    sink        where finished groups go (the data role, or a JSONL file)
    multiturn   multi-turn trajectories: tool calls and environment steps, observations rendered by the
                chat template (loss mask 0), per-token policy versions
    tools       built-in tools (calculator, crop) and the registry of custom ones (named, registered at start-up)
    environments  built-in environments (visual_search), registered classes and HTTP environments at configured URLs
    plugins     loading operator-named code (settings and entry points only, never requests)
    errors      the exception tree
"""

from __future__ import annotations

from .admission import Admission
from .dispatch import Dispatcher, EngineEndpoint, EngineHealth, EngineStream
from .environments import EnvironmentRegistry
from .errors import (
    EngineRefused,
    EnginesUnavailable,
    ExperienceRefused,
    InvalidPrompt,
    MediaRefused,
    Overloaded,
    RolloutError,
    UnknownReward,
    UpstreamUnauthorized,
    UpstreamUnavailable,
    WorkTooLarge,
)
from .group import (
    DEFAULT_ROLLOUT_FUNCTION,
    ChatStream,
    ChoiceLogprobs,
    LogprobAsk,
    Prepared,
    Progress,
    PromptSpec,
    RolloutContext,
    RolloutFunction,
    chat_samples,
    chat_stream,
    generate_n,
    prepare,
    reward_samples,
    rollout_group,
    run_prompt,
    sample_seed,
)
from .multiturn import rollout_multiturn
from .plugins import PluginError
from .prompts import PromptBuilder, parse_messages
from .rewards import BUILTIN_REWARDS, ENTRY_POINT_GROUP, RewardContext, RewardFunction, RewardRegistry, RewardSpec
from .sink import HttpSink, JsonlSink, Sink
from .tools import Observation, ToolContext, ToolError, ToolRegistry

__all__ = [
    "rollout_multiturn",
    "ToolRegistry",
    "ToolError",
    "ToolContext",
    "Observation",
    "EnvironmentRegistry",
    "BUILTIN_REWARDS",
    "DEFAULT_ROLLOUT_FUNCTION",
    "ENTRY_POINT_GROUP",
    "Admission",
    "ChatStream",
    "ChoiceLogprobs",
    "Dispatcher",
    "EngineEndpoint",
    "EngineHealth",
    "EngineRefused",
    "EngineStream",
    "EnginesUnavailable",
    "ExperienceRefused",
    "HttpSink",
    "InvalidPrompt",
    "JsonlSink",
    "LogprobAsk",
    "MediaRefused",
    "Overloaded",
    "PluginError",
    "Prepared",
    "Progress",
    "PromptBuilder",
    "PromptSpec",
    "RewardContext",
    "RewardFunction",
    "RewardRegistry",
    "RewardSpec",
    "RolloutContext",
    "RolloutError",
    "RolloutFunction",
    "Sink",
    "UnknownReward",
    "UpstreamUnauthorized",
    "UpstreamUnavailable",
    "WorkTooLarge",
    "chat_samples",
    "chat_stream",
    "generate_n",
    "parse_messages",
    "prepare",
    "reward_samples",
    "rollout_group",
    "run_prompt",
    "sample_seed",
]
