"""The twin's records, in one module that every other one imports (so none imports another for a type): a cost
model's figures (`Prediction`), a live run's (`RunFigures`, `TwinRun`, with the data role's `DataLoad`) and the
report made of them (`TwinRow`, `ControlPlane`, `ScalingPoint`, `Calibration`, `TwinSummary`).

They are JSON: ``results.json`` holds a `TwinSummary` (``--merge`` reads its rows back), ``plan.json`` a list
of `Prediction`."""

from __future__ import annotations

from typing import NotRequired, TypedDict

__all__ = [
    "Calibration",
    "ControlPlane",
    "DataLoad",
    "Occupancy",
    "Prediction",
    "RunFigures",
    "ScalingPoint",
    "TwinRow",
    "TwinRun",
    "TwinSummary",
]


class Occupancy(TypedDict):
    """How full engines ran over a span (`twin.model.occupancy`): an engine can be busy all the time with half the
    batch it could run, which no idle share shows."""

    engine_batch_mean: float  # running requests per engine, averaged over the span
    engine_kv_share_mean: float  # the KV pool's share held, averaged likewise
    engine_tokens_per_s: float  # generated tokens per second per engine


class Prediction(TypedDict):
    """A cost-model run's figures (simulated seconds): each step's time, their mean and 95 % interval (over the
    steps after the first for async: it fills the pipeline), tokens, and what each mode adds."""

    gpus: int
    s_per_step: float
    s_per_step_ci95: float
    step_s: list[float]
    tokens_per_step: float
    tokens_per_s_per_gpu: float
    engine_gpus: NotRequired[int]  # async: the split
    trainer_gpus: NotRequired[int]
    staleness: NotRequired[int]
    engine_idle_share: NotRequired[float | None]
    trainer_idle_share: NotRequired[float | None]
    dropped_stale: NotRequired[int]
    staleness_histogram: NotRequired[dict[str, int]]  # versions behind → trained samples
    retractions: NotRequired[int]  # SGLang-style KV retractions over the run
    peak_kv_share: NotRequired[float]  # the fullest engine's peak KV over its capacity
    engine_batch_mean: NotRequired[float]  # async: `Occupancy`'s
    engine_kv_share_mean: NotRequired[float]
    engine_tokens_per_s: NotRequired[float]
    trainer_data_wait_s: NotRequired[float]  # per step: the trainer found nothing to train (Relax: 0.11 s)
    rollout_residual_s: NotRequired[float]  # one-step-off: the generation the training did not hide, per step
    reference_forward_s: NotRequired[float]  # one-step-off: the reference model's forward, per step
    prompts: NotRequired[int]  # colocate: its step's decomposition
    s_per_step_stdev: NotRequired[float]
    generation_s: NotRequired[float]
    fixed_s: NotRequired[float]
    allreduce_s: NotRequired[float]
    optimizer_s: NotRequired[float]
    mode: NotRequired[str]  # set by `twin.plan.predict`
    label: NotRequired[str]
    overlaps_best: NotRequired[bool]
    worst_s_per_step: NotRequired[float]  # `twin.plan.plan`: the slowest corner of the constants' ranges
    worst_s_per_step_ci95: NotRequired[float]
    worst_corner: NotRequired[str]


class DataLoad(TypedDict, total=False):
    """The data role's load from its /metrics (`twin.live.data_role_load`); empty when it did not answer."""

    groups: int
    ingest_requests: int
    ingest_p99_ms: float | None
    fetch_requests: int
    fetch_p99_ms: float | None
    ack_requests: int
    ack_p99_ms: float | None
    microbatches: int  # delivered (leased), from weir_data_microbatches_delivered_total


class RunFigures(TypedDict):
    """One run's figures from its step records (`twin.live.summarise`); simulated seconds unless wall."""

    mode: str
    compression: float
    gpus: int
    engines: int
    steps: int
    wall_s_per_step: float
    sim_s_per_step: float
    sim_s_per_step_ci95: NotRequired[float]  # over the steady steps (runs recorded before it lack it)
    sim_s_per_token_steps: NotRequired[list[float]]  # each steady step's simulated seconds per trained token
    first_step_sim_s: float
    samples_per_step: float
    tokens_per_step: float
    tokens_per_s_per_gpu: float
    trainer_sim_s_per_step: float
    trainer_allreduce_s_per_step: float  # of trainer_sim_s_per_step: the gradient all-reduce (`trainer.sim_comm`)
    trainer_optimizer_s_per_step: float  # of trainer_sim_s_per_step: the Adam step
    engine_idle_share: float | None
    trainer_idle_share: float | None
    dropped_stale: int
    max_staleness_seen: int
    staleness_histogram: dict[str, int]  # versions behind (a string: a JSON key) → trained samples


class TwinRun(RunFigures):
    """One run of `twin.live.run_mode`: its figures, its layout and the data role's load."""

    nodes: float
    processes: int
    trainer_gpus: int
    data: DataLoad
    data_groups_per_wall_s: float | None
    data_microbatches_per_wall_s: float | None


class TwinRow(TwinRun):
    """A row of the table (`twin.report.twin_table`): the run, its speed-up over colocate and its linearity."""

    speedup: float | None
    linearity: float | None


class ControlPlane(TypedDict):
    """`twin.report.control_plane`'s decomposition ``w = S / c + P`` of one mode at one size."""

    gpu_sim_s: float
    plane_wall_s: float
    plane_share_low: float
    plane_share_high: float
    moved: float
    moved_per_token: NotRequired[float]
    # two-sided: the relative change of s/token from the lowest to the highest factor, its 95 % interval (Welch)
    moved_ci95: NotRequired[list[float]]  # [low, high]
    verdict: NotRequired[str]  # "GPU-bound", "control-plane-bound" or "undecided"


class ScalingPoint(TypedDict):
    """One size of a mode in `twin.report.scaling`."""

    gpus: int
    gpu_sim_s: float
    tokens_per_step: float
    tokens_per_s_per_gpu: float
    factors: list[float]
    left_out: list[float]
    linearity: NotRequired[float]


# The calibration's keys are per mode ("gpus", "<mode>_basis", "<mode>_s_per_step", "colocate_error",
# "<mode>_speedup"), so a mapping rather than a fixed set of keys: the bases are strings, the rest numbers.
Calibration = dict[str, float | str]


class TwinSummary(TypedDict):
    """`twin.report.summary`: what `weir twin` prints, plots and writes to ``results.json``."""

    rows: list[TwinRow]
    control_plane: dict[str, ControlPlane]  # by "<mode>@<gpus>"
    scaling: dict[str, list[ScalingPoint]]  # by mode
    calibration: Calibration
    relax: dict[str, float]
