"""A PNG of a training run's reward and throughput over time (several runs overlaid, e.g. async vs colocate)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on training machines

import matplotlib.pyplot as plt  # noqa: E402 - after choosing the backend

__all__ = ["plot_runs"]


def _smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_runs(runs: Mapping[str, Sequence[Mapping[str, Any]]], path: str | Path, *, window: int = 5) -> Path:
    """Reward (moving mean over ``window`` steps) and samples/s against wall time, one line per run; a run's
    periodic evaluations (records with ``eval``) as greedy pass@1 markers beside its reward."""
    figure, (reward_axis, rate_axis) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    for name, records in runs.items():
        if not records:
            continue
        times = [r["time_s"] for r in records]
        rewards = _smooth([r["mean_reward"] for r in records], window)
        line = reward_axis.plot(times, rewards, label=name)[0]
        evaluated = [(r["time_s"], r["eval"]) for r in records if r.get("eval")]
        if evaluated:  # periodic evaluation beside the training reward: greedy pass@1 as markers
            reward_axis.plot(
                [t for t, _ in evaluated], [e["pass@1"] for _, e in evaluated], "o--", color=line.get_color(),
                label=f"{name}: held-out pass@1 (greedy)",
            )  # fmt: skip
        rate_axis.plot(times, [r["samples_per_s"] for r in records], label=name)
    reward_axis.set_ylabel(f"mean reward ({window}-step moving mean)")
    reward_axis.set_ylim(-0.02, 1.02)
    reward_axis.grid(alpha=0.3)
    reward_axis.legend(loc="lower right")
    rate_axis.set_ylabel("samples trained / s (cumulative)")
    rate_axis.set_xlabel("wall time (s)")
    rate_axis.grid(alpha=0.3)
    figure.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out
