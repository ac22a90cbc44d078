"""The default rollout: one prompt → its ``n`` samples → one typed, rewarded `Group`; and running a
rollout function for a request (`run_prompt`), which records the group.

`rollout_group` is what ``WEIR_ROLLOUT_FUNCTION`` names unless the operator names another function with
the same signature (`rollout.context.RolloutFunction`), which gets the same `RolloutContext` and may use
the same building blocks: `rollout.preparation.prepare`, `rollout.generation.generate_n`,
`rollout.scoring.reward_samples`. Per prompt: prepare it (media preprocessed and encoded, placeholders
expanded), generate the ``n`` samples under the admission bound, reward each ok sample; a failed sample
says why and the rest of the group is still returned. A prompt with tools, an environment or
``max_turns`` is rolled out turn by turn instead (`rollout.multiturn`). Recording a group (the sink) is
`run_prompt`'s job, not the rollout function's. This module does not speak to clients (no HTTP server, no
wire schemas) and keeps no metrics.
"""

from __future__ import annotations

import uuid

from engines.protocol import SamplingParams
from experience.records import Group
from preprocess.budget import TokenBudget

from .context import PromptSpec, RolloutContext, RolloutFunction
from .generation import generate_n
from .multiturn import rollout_multiturn
from .preparation import prepare, with_max_new_tokens
from .scoring import GroupTimer, assemble_group, reward_samples

__all__ = ["DEFAULT_ROLLOUT_FUNCTION", "rollout_group", "run_prompt"]

DEFAULT_ROLLOUT_FUNCTION = "rollout.group:rollout_group"


async def rollout_group(
    ctx: RolloutContext,
    prompt: PromptSpec,
    /,
    *,
    index: int,
    sampling: SamplingParams,
    budget: TokenBudget | None,
) -> Group:
    """The default rollout function: prepare the prompt, generate ``n`` samples, reward them. A prompt
    with tools, an environment or ``max_turns`` is rolled out turn by turn (`rollout.multiturn`)."""
    if prompt.multiturn:
        return await rollout_multiturn(ctx, prompt, index=index, sampling=sampling, budget=budget)
    timer = GroupTimer()
    where = f"prompts[{index}]"
    prepared = await prepare(ctx, prompt.messages, where=f"{where}.messages", budget=budget)
    sampling = with_max_new_tokens(ctx, prepared, sampling, where)
    group_id = prompt.group_id or uuid.uuid4().hex
    with ctx.admission.admit(media_tokens=prepared.media_tokens * prompt.n), timer.generating():
        samples = await generate_n(ctx, prepared, sampling, group_id=group_id, n=prompt.n)
    timer.rewarding()
    samples = await reward_samples(ctx, prompt.reward, samples, group_id=group_id, prompt_index=index)
    return assemble_group(prepared, samples, group_id=group_id, index=index, timer=timer)


async def run_prompt(
    ctx: RolloutContext,
    function: RolloutFunction,
    prompt: PromptSpec,
    *,
    index: int,
    sampling: SamplingParams,
    budget: TokenBudget | None,
    record: bool,
) -> Group:
    """``function``'s group for ``prompt``, appended to the sink when ``record`` (an evaluation is not)."""
    group = await function(ctx, prompt, index=index, sampling=sampling, budget=budget)
    if not isinstance(group, Group):
        raise TypeError(f"the rollout function {function!r} returned {type(group).__name__}, not a Group")
    if record:
        await ctx.sink.append(group)
    return group
