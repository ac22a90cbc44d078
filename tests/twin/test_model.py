"""The twin's cost model alone (`twin.model`) and what is asked of it (`twin.plan`): the virtual
clock gives the wall clock's exact sums, the KV cache is never exceeded, async obeys the staleness bound and
its two limits (trainer-bound, engine-bound), and plan / sensitivity / calibration / the CLI do what they say."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from engines import GenerateRequest, SamplingParams
from engines.sim_backend import SimEngine, SimProfile
from launcher.cli import main
from trainer.sim_trainer import SimTrainer, SimTrainerProfile
from twin.intervals import interval, welch
from twin.model import AsyncModel, async_cost_model, colocate_cost_model, prompt_ids, trainer_profile
from twin.plan import (
    Candidate,
    calibrate,
    candidates,
    plan,
    read_lengths,
    sensitivity,
    with_lengths,
    write_calibration,
)

from .profiles import short_profile as _profile


def test_the_virtual_clock_gives_the_wall_clocks_exact_sums(tmp_path: Path) -> None:
    """The same colocate step on threaded sim engines at a high compression (the live twin's engines) and in
    virtual time: the busiest engine's simulated seconds and the tokens agree to rounding."""
    profile = _profile(tmp_path / "p.yaml")
    model = colocate_cost_model(profile, 3, prompts=5, n=4, steps=1)
    engine = SimEngine(SimProfile.load(profile), compression=1e6, replicas=3)
    try:
        engine.pause("in_place")  # every request waits: the batch is admitted together, as in the model
        futures = [
            engine.submit(
                GenerateRequest(input_ids=prompt_ids(p), sampling=SamplingParams(max_new_tokens=256, sampling_seed=i))
            )
            for p in range(5)
            for i in range(4)
        ]
        engine.resume()
        results = [f.result(60) for f in futures]
        busiest = max(r.stats.busy_s for r in engine.replicas)
    finally:
        engine.close()
    assert model["generation_s"] == pytest.approx(busiest, rel=1e-9)
    assert model["tokens_per_step"] == sum(len(r.output_ids) + r.prompt_tokens for r in results)


def test_verls_hybrid_engine_saves_the_offload_and_the_push(tmp_path: Path) -> None:
    profile = _profile(tmp_path / "p.yaml")
    colocate = colocate_cost_model(profile, 2, prompts=4, n=4, steps=2)
    hybrid = colocate_cost_model(profile, 2, prompts=4, n=4, steps=2, hybrid=True)
    trainer = yaml.safe_load(profile.read_text())["trainer"]
    saved = sum(trainer[k]["value"] for k in ("offload_s", "onload_s", "weight_sync_broadcast_s"))
    assert colocate["fixed_s"] - hybrid["fixed_s"] == pytest.approx(saved)
    assert colocate["generation_s"] == hybrid["generation_s"]


def test_the_kv_cache_is_never_exceeded_and_retractions_are_counted(tmp_path: Path) -> None:
    """A KV cache of a few requests' worth: engines retract (SGLang's retract_decode) and recompute, and no
    engine ever holds more tokens than its capacity."""
    profile = _profile(tmp_path / "p.yaml", kv_capacity_tokens=2000, max_response_tokens=512, length_median=300)
    engine = SimProfile.load(profile)
    trainer = SimTrainer(SimTrainerProfile.load(profile), engine=engine, gpus=1, sleep=False)
    model = AsyncModel(engine=engine, trainer=trainer, engines=2, prompts=4, n=4, staleness=1).run(4)
    stats = [r.stepper.stats for r in model.replicas]
    assert sum(s.retractions for s in stats) > 0
    assert all(0 < s.peak_kv_tokens <= engine.kv_capacity_tokens for s in stats)
    assert model.figures()["peak_kv_share"] <= 1.0


@pytest.mark.parametrize("bound", [0, 1, 3])
def test_async_trains_every_step_whole_within_the_staleness_bound(tmp_path: Path, bound: int) -> None:
    profile = _profile(tmp_path / "p.yaml")
    out = async_cost_model(profile, engine_gpus=2, trainer_gpus=2, staleness=bound, prompts=4, n=4, steps=6)
    assert len(out["step_s"]) == 6 and all(s > 0 for s in out["step_s"])
    assert max(int(k) for k in out["staleness_histogram"]) <= bound
    assert sum(out["staleness_histogram"].values()) == 6 * 4 * 4  # every step trains prompts x n samples
    assert out["s_per_step_ci95"] >= 0 and out["tokens_per_s_per_gpu"] > 0


def test_async_meets_its_two_limits(tmp_path: Path) -> None:
    """Many engines, a slow trainer: the step is the trainer's work (nothing waits on generation). One engine,
    a fast trainer: the step is at least the engine's generation of the step's samples."""
    profile = _profile(tmp_path / "p.yaml")
    slow = async_cost_model(
        profile, engine_gpus=8, trainer_gpus=1, staleness=2, prompts=4, n=4, steps=8,
        trainer_overrides={"train_tokens_per_gpu_s": 200.0},
    )  # fmt: skip
    trainer = SimTrainer(SimTrainerProfile.load(profile), engine=SimProfile.load(profile), gpus=1, sleep=False)
    fixed = trainer.allreduce_seconds() + trainer.optimizer_seconds() + trainer.weight_sync_seconds()
    per_step = slow["tokens_per_step"] / 200.0 + fixed + SimProfile.load(profile).weight_update_s
    assert slow["s_per_step"] == pytest.approx(per_step, rel=0.05)
    assert (slow.get("trainer_idle_share") or 0.0) < 0.1

    long = _profile(tmp_path / "long.yaml", length_median=1500, max_response_tokens=4096)  # generation >> an update
    fast = async_cost_model(long, engine_gpus=1, trainer_gpus=4, staleness=2, prompts=4, n=4, steps=6)
    assert (fast.get("engine_idle_share") or 0.0) < 0.25 < (fast.get("trainer_idle_share") or 0.0)


def test_async_admission_sized_from_the_step_beats_a_cap_of_half_a_step(tmp_path: Path) -> None:
    """The cost model plans with the data role's own admission rule (`experience.staleness.admission_limit`),
    told the step: at bound 1 a whole step may wait. The old fixed cap (``max_queued_groups``), here half a
    step, lets only half the step's groups generate at once: with engines to spare and a fast trainer, each
    step is longer (as 256 queued groups were at 512 prompts a step)."""
    profile = _profile(tmp_path / "p.yaml")
    engine = SimProfile.load(profile)

    def run(cap: int | None) -> AsyncModel:
        trainer = SimTrainer(
            trainer_profile(profile, {"train_tokens_per_gpu_s": 1e6}), engine=engine, gpus=1, sleep=False
        )
        model = AsyncModel(
            engine=engine, trainer=trainer, engines=8, prompts=8, n=4, staleness=1, max_queued_groups=cap
        )
        return model.run(6)

    sized, capped = run(None), run(4)
    assert sized.figures()["s_per_step"] < 0.9 * capped.figures()["s_per_step"]
    assert max(sized.trained_staleness) <= 1 and max(capped.trained_staleness) <= 1


def test_interval_is_students_t() -> None:
    mean, half = interval([10.0, 12.0, 11.0, 13.0, 9.0])
    assert mean == 11.0
    assert half == pytest.approx(2.776 * math.sqrt(2.5) / math.sqrt(5), rel=1e-3)  # t(0.975, 4) = 2.776
    assert interval([5.0]) == (5.0, 0.0)
    # Welch on two samples with unequal spread: the difference of means, its half-width from the pooled-free
    # standard error and the Welch-Satterthwaite degrees of freedom (here 5.02 -> t(5) = 2.571)
    diff, half = welch([10.0, 12.0, 11.0, 13.0, 9.0], [20.0, 21.0, 20.5, 19.5, 20.0])
    se = math.sqrt(2.5 / 5 + 0.325 / 5)
    assert diff == pytest.approx(9.2) and half == pytest.approx(2.571 * se, rel=1e-3)


def test_plan_ranks_every_split_and_bound(tmp_path: Path) -> None:
    profile = _profile(tmp_path / "p.yaml")
    assert [c.label for c in candidates(4, (0, 1))] == [
        "colocate 4", "async-0 1:3", "async-0 2:2", "async-0 3:1", "async-1 1:3", "async-1 2:2", "async-1 3:1",
    ]  # fmt: skip
    assert len(candidates(16, (1,))) == 1 + 7  # eighths
    results = plan(profile, 4, prompts=4, n=4, steps=4, staleness=(0, 1), workers=1)
    assert len(results) == 7
    assert [r["s_per_step"] for r in results] == sorted(r["s_per_step"] for r in results)
    assert results[0]["overlaps_best"]


def test_sensitivity_moves_the_way_each_knob_does(tmp_path: Path) -> None:
    profile = _profile(tmp_path / "p.yaml")
    out = sensitivity(profile, Candidate("colocate", 2, 0), prompts=4, n=4, steps=3, workers=1)
    base = out["base"]["s_per_step"]
    assert out["length"]["low"] < base < out["length"]["high"]  # longer answers: slower
    assert out["mfu"]["high"] < base < out["mfu"]["low"]  # more efficient GPUs: faster
    assert out["bandwidth"]["high"] < base < out["bandwidth"]["low"]
    assert out["length"]["share"] == 0.15 and out["mfu"]["share"] == 0.10


def test_calibration_fits_one_knob_and_writes_it_into_the_profile(tmp_path: Path) -> None:
    profile = _profile(tmp_path / "p.yaml", max_response_tokens=1024)
    base = colocate_cost_model(profile, 2, prompts=4, n=4, steps=3)["s_per_step"]
    fit = calibrate(profile, target_s=base * 1.1, gpus=2, prompts=4, n=4, steps=3, tolerance=0.01)
    assert fit["knob"] == "length_median" and fit["value"] > 60
    assert fit["s_per_step"] == pytest.approx(base * 1.1, rel=0.01)
    out = write_calibration(profile, fit, tmp_path / "calibrated.yaml", source="a test")
    assert SimProfile.load(out).length_median == fit["value"]
    again = write_calibration(out, fit, tmp_path / "again.yaml", source="a test")  # a second fit replaces the first
    data = yaml.safe_load(again.read_text())
    assert data["calibration"]["fitted_on"] == "a test" and again.read_text().count("calibration:") == 1
    with pytest.raises(ValueError, match="length_median"):
        calibrate(profile, target_s=1.0, gpus=2, prompts=4, knob="mfu")
    with pytest.raises(ValueError, match="out of the knob's reach"):
        calibrate(profile, target_s=base * 100, gpus=2, prompts=4, n=4, steps=2)


def test_weir_twin_plan_and_the_cost_model_from_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = _profile(tmp_path / "p.yaml")
    common = ["--profile", str(profile), "--n", "4", "--prompts-per-step", "4", "--model-steps", "3"]
    assert main(["twin", "plan", "--gpus", "4", "--staleness", "1", *common, "--home", str(tmp_path / "h")]) == 0
    printed = capsys.readouterr().out
    assert "best by its worst case: " in printed and "tokens/s/GPU" in printed
    assert len(json.loads((tmp_path / "h" / "plan.json").read_text())) == 4
    argv = ["twin", "--cost-model", "--engine-gpus", "3", "--trainer-gpus", "1", "--modes", "async-1", *common]
    assert main(argv) == 0
    first = json.loads(capsys.readouterr().out.splitlines()[0])
    assert (first["engine_gpus"], first["trainer_gpus"]) == (3, 1) and set(first["sensitivity"]) == {
        "length", "mfu", "bandwidth"
    }  # fmt: skip
    assert main(["twin", "--cost-model", "--engine-gpus", "4", "--gpus", "4", *common]) == 2
    assert "leaves no engine or no trainer GPU" in capsys.readouterr().err
    assert main(["twin", "--cost-model", "--modes", "partial-1", *common]) == 2
    assert "partial rollouts" in capsys.readouterr().err


def test_the_gpu_bound_test_is_two_sided() -> None:
    from twin.report import bound_verdict, control_plane

    assert bound_verdict(-0.03, 0.04) == "GPU-bound"
    assert bound_verdict(0.08, 0.2) == "control-plane-bound"
    assert bound_verdict(-0.02, 0.09) == "undecided"  # not shown either way: more steps
    assert bound_verdict(-0.09, 0.01) == "undecided"  # faster at the higher factor is not GPU-bound either

    def run(c: float, per_token: list[float]) -> Any:
        tokens = 1000.0
        sim = tokens * sum(per_token) / len(per_token)
        return {"compression": c, "wall_s_per_step": sim / c, "sim_s_per_step": sim, "tokens_per_step": tokens,
                "sim_s_per_token_steps": per_token}  # fmt: skip

    same = control_plane(run(10, [1.0, 1.01, 0.99, 1.0]), run(20, [1.0, 0.99, 1.01, 1.0]))
    assert same["verdict"] == "GPU-bound" and same["moved_ci95"][0] < 0 < same["moved_ci95"][1]
    slower = control_plane(run(10, [1.0, 1.01, 0.99, 1.0]), run(20, [1.3, 1.31, 1.29, 1.3]))
    assert slower["verdict"] == "control-plane-bound"


def test_response_lengths_from_a_users_file(tmp_path: Path) -> None:
    """A file of measured lengths replaces the log-normal: the drawn lengths follow its histogram."""
    lengths = [200 + (37 * i) % 1800 for i in range(500)]  # 200..1999, flat
    (tmp_path / "lengths.csv").write_text("length\n" + "\n".join(map(str, lengths)) + "\n\n")
    assert read_lengths(tmp_path / "lengths.csv") == lengths
    (tmp_path / "lengths.json").write_text(json.dumps(lengths))
    out = with_lengths(
        _profile(tmp_path / "p.yaml", max_response_tokens=4096), tmp_path / "lengths.json", tmp_path / "o.yaml"
    )
    profile = SimProfile.load(out)
    assert sum(w for _, _, w in profile.length_histogram) == 500
    assert profile.length_histogram[0][0] == min(lengths) and profile.length_histogram[-1][1] == max(lengths)
    drawn = sorted(profile.draw_length(prompt_ids(i), s) for i in range(200) for s in range(4))
    assert drawn[0] >= min(lengths) and drawn[-1] <= max(lengths)
    assert abs(drawn[len(drawn) // 2] - 1100) < 150  # the flat file's median
    (tmp_path / "empty.txt").write_text("n/a\n")
    with pytest.raises(ValueError, match="no response lengths"):
        read_lengths(tmp_path / "empty.txt")
