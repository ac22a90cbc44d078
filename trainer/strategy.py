"""The rollout strategy: how generation and training take turns in the RL loop — `Async` (overlapped)
or `Colocate` (one after the other). Each says, per step, how many samples the step trains and whether
the step ends with a publish; `rollout_strategy` picks one by ``LoopConfig.mode``.

``async``: the driver keeps groups in flight against the rollout role while the trainer trains; a
step is ``samples_per_step`` samples and weights go out every ``publish_every`` steps. ``colocate``:
a whole batch of groups is generated before anything trains on it, the step trains all of it, and
weights go out after every step — the baseline the async mode is measured against.

How prompts are sent (admission, regeneration) is `trainer.driver`'s; only rank 0 drives rollouts.
"""

from __future__ import annotations

from typing import Literal, Protocol

from .driver import RolloutDriver
from .lockstep import Lockstep
from .readings import Readings

__all__ = ["Async", "Colocate", "RolloutStrategy", "rollout_strategy"]

# A generated batch can come back with nothing trainable (every sample failed): this many tries, then an error.
_GENERATE_TRIES = 5


class RolloutStrategy(Protocol):
    def start(self) -> None:
        """Before the first step."""

    def target(self) -> int:
        """How many samples (over all ranks) this step trains; blocks while the strategy makes them."""

    def publishes(self, step: int) -> bool:
        """Whether ``step`` ends with a publish."""


class Async:
    """Rollouts overlapped with training: the driver's background requests start with the loop."""

    def __init__(self, driver: RolloutDriver, ranks: Lockstep, *, samples_per_step: int, publish_every: int) -> None:
        self.driver, self.ranks = driver, ranks
        self.samples_per_step, self.publish_every = samples_per_step, publish_every

    def start(self) -> None:
        if self.ranks.main:
            self.driver.start()

    def target(self) -> int:
        return self.samples_per_step

    def publishes(self, step: int) -> bool:
        return step % self.publish_every == 0


class Colocate:
    """Generate a whole batch (``groups`` groups), then train on all of it, then publish — and only then
    generate again. The step trains what the data role's queue holds (rank 0's count, on every rank)."""

    def __init__(self, driver: RolloutDriver, ranks: Lockstep, readings: Readings, *, groups: int) -> None:
        self.driver, self.ranks, self.readings, self.groups = driver, ranks, readings, groups

    def start(self) -> None:
        pass

    def target(self) -> int:
        queued = 0
        if self.ranks.main:
            queued = self.readings.stats().queue_samples
            for _ in range(_GENERATE_TRIES):
                if queued > 0:
                    break
                # The barrier: the whole batch is generated before anything trains on it.
                self.driver.generate(self.groups)
                queued = self.readings.stats().queue_samples
        queued = int(self.ranks.from_main(queued))
        if queued == 0:
            raise RuntimeError("five generated batches in a row held no trainable sample")
        return queued

    def publishes(self, step: int) -> bool:
        return True


def rollout_strategy(
    mode: Literal["async", "colocate"],
    driver: RolloutDriver,
    ranks: Lockstep,
    readings: Readings,
    *,
    samples_per_step: int,
    groups_per_step: int,
    publish_every: int,
) -> RolloutStrategy:
    if mode == "colocate":
        return Colocate(driver, ranks, readings, groups=groups_per_step)
    return Async(driver, ranks, samples_per_step=samples_per_step, publish_every=publish_every)
