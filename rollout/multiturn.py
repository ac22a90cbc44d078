"""Multi-turn rollouts: the model calls registered tools (or acts in an environment) turn by turn, and one
trajectory — prompt, then the model's turns and the observations between them — is one `Sample`.

Per sample, each turn generates from the full token sequence so far (prompt + every segment, every
medium so far in order) until the model ends its turn (its end-of-turn token; a ``<tool_call>`` block is
parsed after the fact with `rollout.toolcalls.parse_calls`, so the model's tokens are kept exactly as
sampled). A call is run (`rollout.tools`: registered tools, over the environment's ``state``) or handed to
the environment's ``step``; its observation is appended as a ``tool`` turn whose tokens are exactly what
the chat template makes of it, its images preprocessed, budgeted and expanded like a prompt's
(`rollout.observations`).

Recorded per response token: ``loss_mask`` 1 on the model's tokens, 0 on observations (whose log-probs
are 0.0); ``token_versions`` from each engine answer's ``weight_version``; the sample's
``policy_version`` is its oldest model token's; ``feature_keys`` are the observations' media in order.
Finish reasons: ``stop`` (the model answered without a call, or the environment said done), ``length``
(``max_new_tokens`` bounds the whole response, observations included; an observation that would
overflow it is not appended), ``max_turns`` (the last allowed turn still called a tool), ``tool_error``
(a tool or the environment raised, ran late, or its media were refused — by the preprocess role, or by
the in-flight admission bound: an observation's media tokens are admitted like a prompt's, for one
sample, and held until its trajectory ends). A bad call (`ToolError`) is an
``error: ...`` observation instead, and the trajectory goes on.

Rewards: with an environment, the sum of its step rewards (0.0 when it gave none), plus the prompt's
reward spec on the final text when one is given; without, the prompt's reward spec on the final text (the
model's last turn, which is ``Sample.text``). A ``tool_error`` trajectory has no reward: a broken tool
says nothing about the policy, so it is recorded but never trained on.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engines.api import MediaRef
from engines.protocol import SamplingParams
from experience.records import Group, Sample, SampleFinishReason, SampleStatus
from preprocess.api import MediaItem
from preprocess.budget import TokenBudget

from .context import PromptSpec, RolloutContext
from .environments import Environment, EnvironmentRef, PromptInfo, Step, step_of
from .errors import InvalidPrompt, Overloaded, UpstreamUnavailable, WorkTooLarge
from .generation import generate, sample_sampling, sample_seed
from .messages import FunctionTool, TemplateMessage
from .observations import render_observations, user_turn
from .preparation import Prepared, prepare, with_max_new_tokens
from .prompts import parse_messages
from .scoring import GroupTimer, assemble_group, reward_samples
from .toolcalls import parse_calls
from .tools import (
    DEFAULT_TIMEOUT_S,
    Observation,
    Tool,
    ToolCall,
    ToolContext,
    ToolError,
    ToolFailed,
    observation_of,
)

__all__ = ["DEFAULT_MAX_TURNS", "rollout_multiturn"]

DEFAULT_MAX_TURNS = 8


@dataclass(slots=True)
class _Trajectory:
    """One sample's growing state."""

    prompt: Prepared
    conversation: list[TemplateMessage]
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    media: list[MediaRef] = field(default_factory=list)
    inline: list[MediaItem] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)  # the observations' media tokens, per kind
    rewards: list[float] = field(default_factory=list)
    text: str = ""

    def prepared(self) -> Prepared:
        """The whole sequence so far as one prompt for the engines: every medium so far, in order."""
        p = self.prompt
        return Prepared(
            prompt_ids=p.prompt_ids + self.response,
            media=p.media + self.media,
            inline=p.inline + self.inline,
            feature_keys=p.feature_keys + self.keys,
            token_counts=p.token_counts,
            preprocess_s=0.0,
        )


class _Ended(Exception):
    def __init__(self, reason: SampleFinishReason, error: str | None = None) -> None:
        super().__init__(error or reason)
        self.reason, self.error = reason, error


async def _in_worker(function: Any, *args: Any, timeout_s: float, what: str) -> Any:
    """An environment's ``reset`` / ``step`` in a worker thread under a deadline; `ToolError` passes."""
    try:
        return await asyncio.wait_for(asyncio.to_thread(function, *args), timeout_s)
    except ToolError:
        raise
    except TimeoutError:
        raise ToolFailed(f"{what} ran past its {timeout_s:g} s deadline") from None
    except Exception as error:  # noqa: BLE001 - operator code: its failure ends the trajectory, as data
        raise ToolFailed(f"{what} failed: {type(error).__name__}: {error}") from None


async def rollout_multiturn(
    ctx: RolloutContext,
    prompt: PromptSpec,
    /,
    *,
    index: int,
    sampling: SamplingParams,
    budget: TokenBudget | None,
) -> Group:
    """A `RolloutFunction` for prompts with ``tools``, an ``environment`` or ``max_turns`` (`rollout_group`
    hands those here): ``n`` trajectories, rewarded, as one `Group`."""
    timer = GroupTimer()
    where = f"prompts[{index}]"
    group_id = prompt.group_id or uuid.uuid4().hex
    max_turns = prompt.max_turns or DEFAULT_MAX_TURNS
    environment: EnvironmentRef | None = prompt.environment
    envs: list[Environment] = []
    messages = list(prompt.messages)
    if environment is not None:
        try:
            envs = [environment.build() for _ in range(prompt.n)]
        except (TypeError, ValueError) as error:
            raise InvalidPrompt(
                f"{where}.environment.options: {type(error).__name__}: {error}", code="invalid_environment"
            ) from None
        try:
            firsts = [
                await _in_worker(
                    env.reset,
                    PromptInfo(messages=messages, group_id=group_id, sample_index=i, prompt_index=index),
                    timeout_s=environment.timeout_s,
                    what=f"environment {environment.name!r} reset",
                )
                for i, env in enumerate(envs)
            ]
        except (ToolFailed, ToolError) as error:  # no prompt without it: the request's error, not a sample's
            raise UpstreamUnavailable(f"{where}.environment: {error}", code="environment_failed") from None
        shown = [user_turn(observation_of(f)) if f is not None else None for f in firsts]
        if any(s != shown[0] for s in shown):  # a group shares one prompt: reset must not depend on the sample
            raise InvalidPrompt(
                f"{where}.environment: {environment.name!r} reset differently for the samples of one group",
                code="invalid_environment",
            )
        if shown[0] is not None:
            messages.append(shown[0])
    tools = [t.schema for t in prompt.tools]
    prepared = await prepare(ctx, messages, where=f"{where}.messages", budget=budget, tools=tools or None)
    template, _ = parse_messages(messages, f"{where}.messages")
    sampling = with_max_new_tokens(ctx, prepared, sampling, where)
    with ctx.admission.admit(media_tokens=prepared.media_tokens * prompt.n), timer.generating():
        runs = await asyncio.gather(
            *(
                _trajectory(
                    ctx,
                    prompt,
                    _Trajectory(prompt=prepared, conversation=list(template)),
                    envs[i] if envs else None,
                    sample_sampling(sampling, i),
                    group_id=group_id,
                    index=i,
                    prompt_index=index,
                    max_turns=max_turns,
                    budget=budget,
                )
                for i in range(prompt.n)
            )
        )
    timer.rewarding()
    samples = await _reward(ctx, prompt, runs, group_id=group_id, index=index)
    counts = dict(prepared.token_counts)
    for _, run in runs:  # the observations' media count too, for every sample
        for kind, n in run.counts.items():
            counts[kind] = counts.get(kind, 0) + n
    return assemble_group(prepared, samples, group_id=group_id, index=index, timer=timer, token_counts=counts)


async def _reward(
    ctx: RolloutContext, prompt: PromptSpec, runs: Sequence[tuple[Sample, _Trajectory]], *, group_id: str, index: int
) -> list[Sample]:
    spec_rewarded = await reward_samples(
        ctx,
        prompt.reward,
        [s for s, _ in runs if s.finish_reason != "tool_error"],
        group_id=group_id,
        prompt_index=index,
    )
    by_index = {s.index: s for s in spec_rewarded}
    out = []
    for sample, run in runs:
        rewarded = by_index.get(sample.index, sample)
        if (
            prompt.environment is not None
            and rewarded.status is SampleStatus.OK
            and sample.finish_reason != "tool_error"
        ):
            total = sum(run.rewards) + (rewarded.reward or 0.0)
            rewarded = dataclasses.replace(rewarded, reward=float(total))
        out.append(rewarded)
    return out


async def _trajectory(
    ctx: RolloutContext,
    prompt: PromptSpec,
    run: _Trajectory,
    env: Environment | None,
    sampling: SamplingParams,
    *,
    group_id: str,
    index: int,
    prompt_index: int,
    max_turns: int,
    budget: TokenBudget | None,
) -> tuple[Sample, _Trajectory]:
    start = time.perf_counter()
    max_new = sampling.max_new_tokens
    tools = {t.name: t for t in prompt.tools}
    timeout_s = prompt.environment.timeout_s if prompt.environment is not None else DEFAULT_TIMEOUT_S
    state = env.state if env is not None and isinstance(getattr(env, "state", None), dict) else {}
    schemas = [t.schema for t in prompt.tools] or None
    reason: SampleFinishReason = "stop"
    error: str | None = None
    held = contextlib.ExitStack()  # the observations' media, admitted as they come, released at the end
    try:
        for turn in range(max_turns):
            room = min(max_new - len(run.response), ctx.context_length - len(run.prompt.prompt_ids) - len(run.response))
            if room <= 0:
                raise _Ended("length")
            seed = sampling.sampling_seed
            if turn and seed is not None:
                seed = sample_seed(seed, turn)  # each turn its own draw, reproducibly
            choice = dataclasses.replace(sampling, max_new_tokens=room, sampling_seed=seed)
            sample = await generate(ctx, run.prepared(), choice, group_id=group_id, index=index)
            if sample.status is SampleStatus.FAILED:
                return dataclasses.replace(sample, timings={"generate_s": time.perf_counter() - start}), run
            version = sample.policy_version or 0
            run.response += sample.response_ids
            run.logprobs += sample.logprobs
            run.mask += [1] * len(sample.response_ids)
            run.versions += [version] * len(sample.response_ids)
            run.text = sample.text
            if sample.status is SampleStatus.ABORTED:
                raise _Ended("abort")
            if sample.finish_reason == "length":
                raise _Ended("length")
            content, calls = parse_calls(sample.text)
            ended = bool(sample.response_ids) and sample.response_ids[-1] in ctx.prompts.eos_ids
            context = ToolContext(state=state, group_id=group_id, sample_index=index, turn=turn)
            added: list[TemplateMessage] = []
            observations: list[Observation] = []
            if not calls:
                if env is None:
                    raise _Ended("stop")
                try:
                    step = await _env_step(env, sample.text, timeout_s, run)
                except ToolError as bad:  # nothing to correct in a final answer: the environment failed on it
                    raise ToolFailed(f"the environment's step refused the answer: {bad}") from None
                if step.done or step.observation is None:
                    raise _Ended("stop")
                if turn == max_turns - 1:
                    raise _Ended("max_turns")
                run.conversation.append({"role": "assistant", "content": sample.text})
                added.append({"role": "user", "content": [{"type": "text", "text": step.observation.text}]})
                observations.append(step.observation)
            else:
                if turn == max_turns - 1:
                    raise _Ended("max_turns")
                run.conversation.append(
                    {
                        "role": "assistant",
                        "content": content or "",
                        # a copy: the conversation keeps the model's arguments whatever a tool does to its own
                        "tool_calls": [
                            {"type": "function", "function": {"name": c.name, "arguments": copy.deepcopy(c.arguments)}}
                            for c in calls
                        ],
                    }
                )
                done = False
                for action in calls:
                    observation, done_now = await _call(tools.get(action.name), action, context, env, timeout_s, run)
                    done = done or done_now
                    observations.append(observation)
                    added.append({"role": "tool", "content": observation.text})
                if done:
                    raise _Ended("stop")
            await _append_observation(ctx, run, added, observations, schemas, ended, version, max_new, budget, held)
        raise _Ended("max_turns")
    except _Ended as end:
        reason, error = end.reason, end.error
    except ToolFailed as failure:
        reason, error = "tool_error", str(failure)
    finally:
        held.close()
    generated = [v for v, m in zip(run.versions, run.mask, strict=True) if m]
    status = SampleStatus.ABORTED if reason == "abort" else SampleStatus.OK
    if not generated and status is SampleStatus.OK:
        return Sample(index=index, status=SampleStatus.FAILED, error=error or "nothing was generated"), run
    return (
        Sample(
            index=index,
            status=status,
            response_ids=run.response,
            logprobs=run.logprobs,
            text=run.text,
            finish_reason=reason,
            policy_version=min(generated) if generated else None,
            error=error,
            loss_mask=run.mask,  # type: ignore[arg-type]
            token_versions=run.versions,
            feature_keys=run.keys,
            timings={"generate_s": time.perf_counter() - start},
        ),
        run,
    )


async def _call(
    tool: Tool | None,
    action: ToolCall,
    context: ToolContext,
    env: Environment | None,
    timeout_s: float,
    run: _Trajectory,
) -> tuple[Observation, bool]:
    """One call's observation, and whether the environment said done; a bad call's observation is its
    ``error: ...``; `ToolFailed` ends the trajectory."""
    try:
        if tool is not None:
            return await tool.run(action.arguments, context), False
        if env is None:
            raise ToolError(f"no tool {action.name!r} here")
        step = await _env_step(env, action, timeout_s, run)
        return step.observation or Observation(), step.done
    except ToolError as bad:
        return Observation(text=f"error: {bad}"), False
    except TypeError as error:  # an observation of the wrong type: the tool is broken
        raise ToolFailed(str(error)) from None


async def _env_step(env: Environment, action: ToolCall | str, timeout_s: float, run: _Trajectory) -> Step:
    """The environment's `Step` (its reward kept); one that raises, is late or answers something else
    is `ToolFailed` (a `ToolError` passes: a bad call)."""
    value = await _in_worker(env.step, action, timeout_s=timeout_s, what="the environment's step")
    try:
        step = step_of(value)
    except TypeError as error:
        raise ToolFailed(f"the environment's step: {error}") from None
    if step.reward is not None:
        run.rewards.append(float(step.reward))
    return step


async def _append_observation(
    ctx: RolloutContext,
    run: _Trajectory,
    added: list[TemplateMessage],
    observations: Sequence[Observation],
    tools: Sequence[FunctionTool] | None,
    ended: bool,
    version: int,
    max_new: int,
    budget: TokenBudget | None,
    held: contextlib.ExitStack,
) -> None:
    """The observations as template-rendered tokens (mask 0), their media preprocessed and expanded and
    admitted (held in ``held`` until the trajectory ends); media the in-flight bound refuses now or
    always (`Overloaded`, `WorkTooLarge`) end the trajectory ``tool_error`` naming the refusal's code."""
    used = run.prompt.media_tokens + sum(run.counts.values())
    shown = await render_observations(
        ctx, run.conversation, added, observations, tools=tools, ended=ended, budget=budget, used=used
    )
    ids = shown.ids
    if len(run.response) + len(ids) >= max_new or (
        len(run.prompt.prompt_ids) + len(run.response) + len(ids) >= ctx.context_length
    ):
        raise _Ended("length")  # no room left to answer after it: the trajectory ends before the observation
    tokens = sum(n for _, n in shown.media)
    if tokens:
        try:
            held.enter_context(ctx.admission.admit(media_tokens=tokens))
        except (Overloaded, WorkTooLarge) as refused:
            raise ToolFailed(f"the observation's media were not admitted ({refused.code}): {refused}") from None
    run.conversation += shown.messages
    run.media += shown.refs
    run.inline += shown.inline
    run.keys += shown.keys
    for kind, n in shown.media:
        run.counts[kind] = run.counts.get(kind, 0) + n
    run.response += ids
    run.logprobs += [0.0] * len(ids)
    run.mask += [0] * len(ids)
    run.versions += [version] * len(ids)
