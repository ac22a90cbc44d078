"""What a rollout function is given and what it must be: the extension point of the rollout role.

`PromptSpec` is one prompt of a request (messages, ``n``, its reward, the multi-turn tools and
environment); `RolloutContext` is everything a rollout function uses, built once by the role (the prompt
builder, the dispatcher, the preprocess / encoder clients, the sink, the reward registry, the admission
bounds); `RolloutFunction` is the signature ``WEIR_ROLLOUT_FUNCTION`` names (the default is
`rollout.group.rollout_group`). This module holds types only: preparing prompts is `rollout.preparation`'s,
generating `rollout.generation`'s, rewarding and grouping `rollout.scoring`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from encoders.client import AsyncEncoderClient
from engines.protocol import SamplingParams
from experience.records import Group
from preprocess.budget import TokenBudget
from preprocess.client import AsyncPreprocessClient

from .admission import Admission
from .dispatch import Dispatcher
from .environments import EnvironmentRef
from .partial import PartialRollouts
from .prompts import PromptBuilder
from .rewards import RewardRegistry, RewardSpec
from .sink import Sink
from .tools import Tool

__all__ = ["PromptSpec", "RolloutContext", "RolloutFunction"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PromptSpec:
    """One prompt of a rollout request: OpenAI-style ``messages``, ``n`` samples, how to reward them,
    and the group id to use (a fresh one when None). Multi-turn (`rollout.multiturn`): the ``tools``
    the model may call and the ``environment`` it acts in — both resolved from the registries built at
    start-up (`rollout.tools.ToolRegistry`, `rollout.environments.EnvironmentRegistry`), never imported
    by name here — and ``max_turns``, the most model turns per trajectory (None: the default)."""

    messages: Sequence[Any]
    n: int = 1
    reward: RewardSpec = field(default_factory=RewardSpec)
    group_id: str | None = None
    tools: Sequence[Tool] = ()
    environment: EnvironmentRef | None = None
    max_turns: int | None = None

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError("n must be at least 1")
        if self.max_turns is not None and self.max_turns < 1:
            raise ValueError("max_turns must be at least 1")

    @property
    def multiturn(self) -> bool:
        """Whether this prompt is rolled out turn by turn (tools, an environment or ``max_turns``)."""
        return bool(self.tools) or self.environment is not None or self.max_turns is not None


@dataclass(slots=True, kw_only=True)
class RolloutContext:
    """Everything a rollout function uses, built once by the role. The HTTP clients carry the API
    token and the request id; whoever built them closes them (`close` closes the dispatcher's own)."""

    prompts: PromptBuilder
    dispatcher: Dispatcher
    preprocess: AsyncPreprocessClient
    encoder: AsyncEncoderClient | None  # None: engines encode media
    sink: Sink
    rewards: RewardRegistry
    admission: Admission
    default_max_tokens: int = 256
    return_routed_experts: bool = False  # ask MoE engines for routing (R3: rollout routing replay)
    reward_timeout_s: float = 30.0
    # A sample a pause (a weight update in abort mode) cut short: "keep" continues it under the new
    # weights (`rollout.partial`), "drop" lets it end aborted.
    partial_rollouts: PartialRollouts = "keep"

    @property
    def context_length(self) -> int:
        return self.prompts.context_length

    async def start(self) -> None:
        """In the serving event loop, before the first request: the sink's own work (a spool ships what a
        previous run left)."""
        await self.sink.start()

    async def close(self) -> None:
        await self.dispatcher.close()
        await self.sink.close()


class RolloutFunction(Protocol):
    """``async def f(ctx, prompt, *, index, sampling, budget) -> Group`` — what ``WEIR_ROLLOUT_FUNCTION`` names.

    ``ctx``: the `RolloutContext`; ``prompt``: the `PromptSpec`; ``index``: the prompt's position in
    its request; ``sampling``: the request's `engines.protocol.SamplingParams` (validated,
    ``max_new_tokens`` set; derive another with `dataclasses.replace`); ``budget``: the preprocess
    `preprocess.budget.TokenBudget` or None (the preprocess role's default). Returns the finished
    `Group` (samples rewarded).
    """

    async def __call__(
        self,
        ctx: RolloutContext,
        prompt: PromptSpec,
        /,
        *,
        index: int,
        sampling: SamplingParams,
        budget: TokenBudget | None,
    ) -> Group: ...
