"""A rollout's last steps, shared by the single-turn rollout (`rollout.group`) and the multi-turn one
(`rollout.multiturn`): samples → rewarded samples → the `Group` record.

`reward_samples` rewards each ok sample with the prompt's `RewardSpec` (a built-in or a function
registered at start-up, `rollout.rewards`), one by one in a worker thread under the context's deadline; a
reward that raises, times out or is not finite marks its sample ``failed`` — as data, never an error of
the group. `assemble_group` gathers a prepared prompt's samples into the `Group` with its timings, which a
`GroupTimer` reads as the rollout goes.
Recording the group (the sink) is `rollout.group.run_prompt`'s job, not this module's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from experience.records import Group, Sample, SampleStatus, sample_id

from .context import RolloutContext
from .preparation import Prepared
from .rewards import RewardContext, RewardSpec

__all__ = ["GroupTimer", "assemble_group", "reward_samples"]

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


@dataclass(slots=True)
class GroupTimer:
    """A group's timings (`time.perf_counter` readings), taken as its rollout goes: made when it starts,
    around the generation (`generating`), as the rewards start (`rewarding`)."""

    started: float = field(default_factory=time.perf_counter)
    generate_s: float = 0.0
    reward_start: float = 0.0

    @contextlib.contextmanager
    def generating(self) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.generate_s = time.perf_counter() - start

    def rewarding(self) -> None:
        self.reward_start = time.perf_counter()


def assemble_group(
    prepared: Prepared,
    samples: list[Sample],
    *,
    group_id: str,
    index: int,
    timer: GroupTimer,
    token_counts: Mapping[str, int] | None = None,
) -> Group:
    """The `Group` of a prepared prompt's rewarded samples, with the timings ``timer`` took (the reward's
    and the total up to now); ``token_counts`` default to the prompt's."""
    return Group(
        group_id=group_id,
        prompt_index=index,
        prompt_ids=prepared.prompt_ids,
        feature_keys=prepared.feature_keys,
        token_counts=dict(prepared.token_counts if token_counts is None else token_counts),
        samples=samples,
        timings={
            "preprocess_s": prepared.preprocess_s,
            "generate_s": timer.generate_s,
            "reward_s": time.perf_counter() - timer.reward_start,
            "total_s": time.perf_counter() - timer.started,
        },
    )
