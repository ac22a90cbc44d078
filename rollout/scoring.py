"""A rollout's last steps, shared by the single-turn rollout (`rollout.group`) and the multi-turn one
(`rollout.multiturn`): samples → rewarded samples → the `Group` record.

`reward_samples` rewards each ok sample with the prompt's `RewardSpec` (a built-in or a function
registered at start-up, `rollout.rewards`), one by one in a worker thread under the context's deadline; a
reward that raises, times out or is not finite marks its sample ``failed`` — as data, never an error of
the group. `assemble_group` gathers a prepared prompt's samples into the `Group` with its timings.
Recording the group (the sink) is `rollout.group.run_prompt`'s job, not this module's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Mapping, Sequence

from experience.records import Group, Sample, SampleStatus, sample_id

from .context import RolloutContext
from .preparation import Prepared
from .rewards import RewardContext, RewardSpec

__all__ = ["assemble_group", "reward_samples"]

logger = logging.getLogger(__name__)


async def reward_samples(
    ctx: RolloutContext, spec: RewardSpec, samples: Sequence[Sample], *, group_id: str, prompt_index: int
) -> list[Sample]:
    """Each ok sample with its reward; a reward that raises, times out or is not finite marks its
    sample ``failed`` (one by one, in a worker thread, each under ``ctx.reward_timeout_s``)."""
    out: list[Sample] = []
    for sample in samples:
        if sample.status is not SampleStatus.OK or spec.type == "none":
            out.append(sample)
            continue
        context = RewardContext(
            group_id=group_id,
            prompt_index=prompt_index,
            sample_index=sample.index,
            finish_reason=sample.finish_reason,
            response_ids=list(sample.response_ids),
        )
        try:
            value = await asyncio.wait_for(
                asyncio.to_thread(ctx.rewards.compute, spec, sample.text, context), ctx.reward_timeout_s
            )
            if value is not None and not math.isfinite(value):
                raise ValueError(f"the reward is {value}, not a finite number")
            out.append(dataclasses.replace(sample, reward=value))
        except Exception as error:  # noqa: BLE001 - a failing reward marks its sample (as data), not the group
            logger.warning(
                "reward of sample %s failed: %s: %s", sample_id(group_id, sample.index), type(error).__name__, error
            )
            out.append(
                dataclasses.replace(
                    sample, status=SampleStatus.FAILED, reward=None, error=f"reward: {type(error).__name__}: {error}"
                )
            )
    return out


def assemble_group(
    prepared: Prepared,
    samples: list[Sample],
    *,
    group_id: str,
    index: int,
    started: float,
    generate_s: float,
    reward_start: float,
    token_counts: Mapping[str, int] | None = None,
) -> Group:
    """The `Group` of a prepared prompt's rewarded samples, with its timings (``started`` and
    ``reward_start`` are `time.perf_counter` readings); ``token_counts`` default to the prompt's."""
    return Group(
        group_id=group_id,
        prompt_index=index,
        prompt_ids=prepared.prompt_ids,
        feature_keys=prepared.feature_keys,
        token_counts=dict(prepared.token_counts if token_counts is None else token_counts),
        samples=samples,
        timings={
            "preprocess_s": prepared.preprocess_s,
            "generate_s": generate_s,
            "reward_s": time.perf_counter() - reward_start,
            "total_s": time.perf_counter() - started,
        },
    )
