"""Settings of the data role, from ``WEIR_*`` environment variables; a bad value fails at construction."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from experience import AdvantageEstimator, DataConfig, StalenessPolicy
from experience.advantages import StdKind

from ..settings import RoleSettings

__all__ = ["DataSettings"]


class DataSettings(RoleSettings):
    """Every field is ``WEIR_<NAME>``; defaults serve the embedded (laptop) mode."""

    data_dir: Path = Field(
        Path(".weir/data"), description="where the experience store keeps its index and Arrow entries"
    )
    max_staleness: int | None = Field(
        None, ge=0, description="how many policy versions a trained sample may lag the trainer; unset: no bound"
    )
    staleness_policy: StalenessPolicy = Field(
        "drop", description="a sample over max_staleness is dropped ('drop'), or dropped and its prompt regenerated"
    )
    drop_uniform_groups: bool = Field(
        False, description="DAPO dynamic sampling: drop groups whose rewards are all equal (no learning signal)"
    )
    advantage_estimator: AdvantageEstimator = Field(
        "grpo", description="'grpo': (r - mean) / std within the group; 'dr_grpo': r - mean (Dr. GRPO)"
    )
    advantage_std: StdKind = Field(
        "population", description="grpo's standard deviation: 'population' (n) or 'unbiased' (n - 1, as verl and TRL)"
    )
    lease_s: float = Field(
        300.0,
        gt=0,
        le=7 * 24 * 3600,
        description="seconds a fetched micro-batch may go unacknowledged before it is redelivered",
    )
    max_queued_groups: int | None = Field(
        None,
        gt=0,
        description="caps the groups admission lets wait for the trainer; unset: sized from the producer's step "
        "and the staleness bound (experience.staleness.admission_limit)",
    )
    max_wait_s: float = Field(30.0, ge=0, le=3600, description="the longest a GET /v1/microbatches long-poll waits")
    cache_dir: Path | None = Field(
        None, description="the feature cache, to serve micro-batches with their media inline (inline_media=true)"
    )

    def config(self) -> DataConfig:
        """The store's configuration from these settings."""
        return DataConfig(
            max_staleness=self.max_staleness,
            staleness_policy=self.staleness_policy,
            drop_uniform_groups=self.drop_uniform_groups,
            advantage_estimator=self.advantage_estimator,
            advantage_std=self.advantage_std,
            lease_s=self.lease_s,
            max_queued_groups=self.max_queued_groups,
        )
