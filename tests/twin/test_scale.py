"""Weak scaling of the async loop (issue 41): with admission sized from the step, a cluster 16 times larger keeps
its per-GPU throughput and runs its engines as full; the old fixed cap of 256 queued groups — half a step once a
step has 512 prompts — does not, though its engines are never idle.

The fast version scales a short-response profile from 2 + 2 to 16 + 16 GPUs with the old cap set to half the
large step; the slow one is the issue's own run: Relax's profile at 16 and at 256 GPUs, the cap at 256."""

from __future__ import annotations

from pathlib import Path

import pytest

from twin.model import AsyncModel, profiles_for
from twin.records import Prediction

from .profiles import RELAX, short_profile


def _async_1(profile: Path, gpus: int, *, cap: int | None, steps: int) -> Prediction:
    """Relax's layout scaled: half the GPUs generate, half train, two prompts per GPU a step (32 at 16 GPUs)."""
    engine, trainer = profiles_for(profile, gpus // 2, 8, None, None)
    model = AsyncModel(
        engine=engine, trainer=trainer, engines=gpus // 2, prompts=2 * gpus, n=8, staleness=1, max_queued_groups=cap
    )
    return model.run(steps).figures()


def _verdict(small: Prediction, large: Prediction) -> tuple[float, float]:
    """Per-GPU throughput and engines' mean running batch, the large run's over the small one's."""
    return (
        large["tokens_per_s_per_gpu"] / small["tokens_per_s_per_gpu"],
        large["engine_batch_mean"] / small["engine_batch_mean"],
    )


def test_admission_sized_from_the_step_scales_and_a_cap_of_half_a_step_does_not(tmp_path: Path) -> None:
    profile = short_profile(tmp_path / "p.yaml", length_median=300, max_response_tokens=1024)
    small = _async_1(profile, 4, cap=None, steps=6)
    throughput, batch = _verdict(small, _async_1(profile, 32, cap=None, steps=6))
    assert throughput >= 0.95 and batch >= 0.95
    throughput, batch = _verdict(small, _async_1(profile, 32, cap=32, steps=6))  # half the large step's 64 groups
    assert throughput < 0.9 and batch < 0.75


@pytest.mark.slow
def test_relax_profile_256_gpus_keep_the_throughput_of_16() -> None:
    """The issue's figure: 16 and 256 GPUs of Relax's profile at staleness 1 (8 steps; minutes each)."""
    small = _async_1(RELAX, 16, cap=None, steps=8)
    throughput, batch = _verdict(small, _async_1(RELAX, 256, cap=None, steps=8))
    assert throughput >= 0.95 and batch >= 0.95
    throughput, _ = _verdict(small, _async_1(RELAX, 256, cap=256, steps=8))
    assert throughput < 0.95
