"""The rollout library: prompts → engines → rewarded, typed `Group`s, with no HTTP server of its own.

The rollout role (`services.rollout`) builds a `RolloutContext` once and runs a rollout function
(`rollout_group` unless ``WEIR_ROLLOUT_FUNCTION`` names another) per prompt. Modules, each importing only
those listed above it:

    errors        the exception tree
    plugins       loading operator-named code (settings and entry points only, never requests)
    admission     bounds on in-flight media tokens and request bytes
    dispatch      engines: least outstanding, group affinity, one retry elsewhere, health probes
    sink          where finished groups go (the data role, or a JSONL file)
    prompts       OpenAI messages → preprocess items; chat template + exact placeholder expansion
    rewards       built-in rewards and the registry of custom ones (named, registered at start-up)
    partial       the rules for continuing a sample a pause cut short (which aborts, what sampling)
    tool_types    what a tool is told, shows the model and raises (`ToolContext`, `Observation`, `ToolError`)
    sandbox_worker  a tool worker process: limits, imports, one call at a time; the wire both sides speak
    sandbox       the role's pool of tool worker processes: CPU and memory limits, killed whole on a deadline
    tools         built-in tools (calculator, crop) and the registry of custom ones (named, registered at start-up)
    toolcalls     Qwen's ``<tool_call>`` blocks in an answer → typed `ToolCall`s
    environments  built-in environments (visual_search), registered classes and HTTP environments at configured URLs
    logprobs      log-probs beyond the sampled tokens': what an OpenAI request asks, what an engine answers
    context       the extension point: `PromptSpec`, `RolloutContext`, `RolloutFunction`
    preparation   messages (or token ids) → a `Prepared` prompt: media preprocessed and encoded, context checks
    generation    prepared prompt → samples: engine bodies and answers, seeds, continuation across a pause
    scoring       samples → rewarded samples → the `Group` record (single- and multi-turn alike)
    observations  what tools and environments show the model, rendered as a trajectory's tokens (mask 0)
    multiturn     multi-turn trajectories: tool calls and environment steps turn by turn, per-token loss mask
                  and policy versions, environment rewards
    group         the default rollout function (`rollout_group`) and `run_prompt` (which records the group)
    serving       samples for OpenAI requests, whole or streamed (`ChatStream`), with top / prompt log-probs
    chat          OpenAI chat / text-completion shaping: objects, streamed deltas, tool calls
"""

from __future__ import annotations

from .admission import Admission
from .context import PromptSpec, RolloutContext, RolloutFunction
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
from .generation import generate_n, sample_seed
from .group import DEFAULT_ROLLOUT_FUNCTION, rollout_group, run_prompt
from .logprobs import ChoiceLogprobs, LogprobAsk
from .multiturn import rollout_multiturn
from .plugins import PluginError
from .preparation import Prepared, prepare
from .prompts import PromptBuilder, parse_messages
from .rewards import BUILTIN_REWARDS, ENTRY_POINT_GROUP, RewardContext, RewardFunction, RewardRegistry, RewardSpec
from .scoring import reward_samples
from .serving import ChatStream, ChoiceStep, chat_samples, chat_stream
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
    "ChoiceStep",
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
