"""Predictions that can fail (issue 41): veRL's one-step-off pipeline in the cost model (`twin.one_step_off`), the
trainer's data wait and the engines' occupancy in the async model, the ranges of the decisive estimates
(`twin.ranges`), the knob refitted at each corner with every held-out figure's spread (`twin.held_out`), and
`weir twin plan` ranked by the worst corner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from engines.sim_profile import SimProfile
from launcher.cli import main
from trainer.sim_trainer import SimTrainerProfile
from twin.held_out import COMPARED, compare, predict_held_out
from twin.model import async_cost_model, colocate_cost_model
from twin.one_step_off import one_step_off_cost_model
from twin.plan import calibrate, plan
from twin.ranges import Corner, corners, read_ranges

from .profiles import RELAX, short_profile


def _sync(profile: Path) -> float:
    """A one-step-off step's weight sync: the trainer's push and the engines' update."""
    return SimTrainerProfile.load(profile).weight_sync_broadcast_s + SimProfile.load(profile).weight_update_s


def test_one_step_off_engine_bound_is_its_generation_and_the_sync(tmp_path: Path) -> None:
    """A fast trainer: every step waits for the next batch's whole generation (veRL's rollout residual), so a
    step is that generation plus the blocking weight sync, and the residual is what the training did not hide."""
    profile = short_profile(tmp_path / "p.yaml", length_median=400, max_response_tokens=2048)
    out = one_step_off_cost_model(
        profile, engine_gpus=1, trainer_gpus=4, prompts=4, n=4, steps=5, trainer_overrides={"mfu": 0.9}
    )
    assert out["rollout_residual_s"] > 0 and out["trainer_data_wait_s"] == out["rollout_residual_s"]
    assert out["s_per_step"] == pytest.approx(out["generation_s"] + _sync(profile), rel=1e-9)
    assert out["staleness_histogram"] == {"0": 4 * 4, "1": 4 * 4 * 4}  # after the first batch, one version old
    assert len(out["step_s"]) == 5 and out["step_s"][0] > out["s_per_step"]  # step 1 also fills the pipeline


def test_one_step_off_trainer_bound_has_no_residual_and_pays_the_reference_forward(tmp_path: Path) -> None:
    profile = short_profile(tmp_path / "p.yaml")
    slow = {"mfu": 0.001}  # the trainer far slower than the engines
    common = {"engine_gpus": 4, "trainer_gpus": 1, "prompts": 4, "n": 4, "steps": 4, "trainer_overrides": slow}
    with_reference = one_step_off_cost_model(profile, **common)  # type: ignore[arg-type]
    without = one_step_off_cost_model(profile, reference_forward=False, **common)  # type: ignore[arg-type]
    assert with_reference["rollout_residual_s"] == 0 == with_reference["trainer_data_wait_s"]
    assert with_reference["reference_forward_s"] > 0 and without["reference_forward_s"] == 0
    # trainer-bound, the reference forward lands whole on the critical path
    moved = with_reference["s_per_step"] - without["s_per_step"]
    assert moved == pytest.approx(with_reference["reference_forward_s"], rel=0.05)
    assert (with_reference.get("engine_idle_share") or 0) > 0.5


def test_async_model_reports_the_trainers_data_wait_and_the_engines_occupancy(tmp_path: Path) -> None:
    """Relax's trainer waits 0.11 s/step for data: the twin predicts the same figure. A trainer far faster than
    the engines waits most of each step; one far slower never waits. Occupancy is bounded by what an engine holds."""
    profile = short_profile(tmp_path / "p.yaml", length_median=400, max_response_tokens=2048)
    common = {"engine_gpus": 1, "trainer_gpus": 2, "staleness": 1, "prompts": 4, "n": 4, "steps": 5}
    fast = async_cost_model(profile, trainer_overrides={"mfu": 0.9}, **common)  # type: ignore[arg-type]
    slow = async_cost_model(profile, trainer_overrides={"mfu": 0.0005}, **common)  # type: ignore[arg-type]
    assert fast["trainer_data_wait_s"] > 0.5 * fast["s_per_step"]
    assert slow["trainer_data_wait_s"] < 0.05 * slow["s_per_step"]
    engine = SimProfile.load(profile)
    for out in (fast, slow):
        assert 0 < out["engine_batch_mean"] <= engine.max_running
        assert 0 < out["engine_kv_share_mean"] <= 1 and out["engine_tokens_per_s"] > 0
    # the slow trainer holds the engines back through admission: they run emptier batches
    assert slow["engine_batch_mean"] < fast["engine_batch_mean"]


def test_the_shipped_profile_ranges_its_two_decisive_estimates() -> None:
    ranges = read_ranges(RELAX)
    speed, mfu = ranges["decode_speed"], ranges["mfu"]
    assert (speed.low, speed.high, mfu.low, mfu.high) == (0.6, 1.4, 0.15, 0.47)
    assert set(speed.moves) == {"decode_base_s", "decode_per_request_s", "decode_per_context_token_s"}
    assert "Megatron-LM" in mfu.source and "H100" in speed.source
    points = corners(ranges)
    assert points[0] == Corner() and len(points) == 5 and len(set(points)) == 5
    engine = SimProfile.load(RELAX)
    engine_changes, trainer_changes = Corner(0.5, 0.2).overrides(engine, speed.moves)
    assert engine_changes["decode_base_s"] == engine.decode_base_s / 0.5 and trainer_changes == {"mfu": 0.2}


@pytest.mark.parametrize(
    ("entry", "refusal"),
    [
        ({"low": 2.0, "high": 1.0, "source": "s"}, "0 < low <= high"),
        ({"low": 0.0, "high": 1.0, "source": "s"}, "0 < low <= high"),
        ({"low": "a", "high": 1.0, "source": "s"}, "must be numbers"),
        ({"low": 0.5, "high": 1.0}, "has no source"),
        ({"low": 0.5, "high": 1.0, "source": "s", "moves": ["warp_factor"]}, "no engine constant warp_factor"),
        ("fast", "must be {low, high, source}"),
    ],
)
def test_a_bad_range_is_refused_by_name(tmp_path: Path, entry: object, refusal: str) -> None:
    data = yaml.safe_load(RELAX.read_text())
    data["ranges"] = {"decode_speed": entry}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match="ranges.decode_speed") as error:
        read_ranges(path)
    assert refusal in str(error.value)
    data["ranges"] = {"vibes": {"low": 1, "high": 2, "source": "s"}}
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match="not 'vibes'"):
        read_ranges(path)


def test_the_knob_is_refitted_at_a_corner(tmp_path: Path) -> None:
    """Slower decoding at the same published colocate step: the fitted responses are shorter."""
    profile = short_profile(tmp_path / "p.yaml", max_response_tokens=1024)
    target = colocate_cost_model(profile, 2, prompts=4, n=4, steps=3)["s_per_step"] * 1.1
    mine = calibrate(profile, target_s=target, gpus=2, prompts=4, n=4, steps=3, tolerance=0.01)
    engine = SimProfile.load(profile)
    slower = {name: getattr(engine, name) / 0.6 for name in read_ranges(RELAX)["decode_speed"].moves}
    there = calibrate(profile, target_s=target, gpus=2, prompts=4, n=4, steps=3, tolerance=0.01, overrides=slower)
    assert there["s_per_step"] == pytest.approx(target, rel=0.01) == mine["s_per_step"]
    assert there["value"] < mine["value"]


def test_held_out_predictions_carry_no_published_figure_and_compare_says_inside_or_missed(tmp_path: Path) -> None:
    profile = short_profile(tmp_path / "p.yaml", max_response_tokens=1024)
    target = colocate_cost_model(profile, 4, prompts=2, n=2, steps=2)["s_per_step"] * 1.1
    seen: list[str] = []
    held = predict_held_out(
        profile, target_s=target, gpus=4, prompts=2, n=2, steps=2, workers=1, on_done=lambda c: seen.append(c["label"])
    )
    assert [c["label"] for c in held["corners"]] == seen and len(seen) == 5 and seen[0] == Corner().label
    assert (held["engine_gpus"], held["trainer_gpus"], held["steps"]) == (2, 2, 2) and held["revision"]
    for corner in held["corners"]:
        assert corner["fit"]["s_per_step"] == pytest.approx(target, rel=0.002)
        assert set(corner["predictions"]) == {"async-0", "async-1", "one-step-off"}
        assert "trainer_data_wait_s" in corner["predictions"]["async-1"]
    text = json.dumps(held)  # JSON as written, and nothing published in it: the comparison comes later
    assert "published" not in text and "reference" not in text.replace("reference_forward_s", "")
    base = held["corners"][0]["predictions"]
    reference = {
        "staleness1_s_per_step": base["async-1"]["s_per_step"],  # the profile's own point: inside
        "async_s_per_step": 1e6,  # outside every corner
        "trainer_data_wait_s": base["async-1"]["trainer_data_wait_s"],
    }
    rows = {r["reference"]: r for r in compare(held, reference)}
    assert set(rows) == set(reference)  # the others have no published figure here
    assert rows["staleness1_s_per_step"]["inside"] and not rows["async_s_per_step"]["inside"]
    assert rows["trainer_data_wait_s"]["low"] <= rows["trainer_data_wait_s"]["base"]
    assert all(ref in RELAX.read_text() for refs in COMPARED.values() for ref in refs)  # every one is published


def test_plan_ranks_by_the_worst_corner_with_the_knob_refitted_there(tmp_path: Path) -> None:
    profile = short_profile(tmp_path / "p.yaml", max_response_tokens=4096)
    size = {"prompts": 4, "n": 4, "steps": 2, "workers": 1}
    ranked = plan(profile, 4, staleness=(1,), **size)  # type: ignore[arg-type]
    worst = [r["worst_s_per_step"] for r in ranked]
    assert worst == sorted(worst) and all(r["worst_s_per_step"] >= r["s_per_step"] for r in ranked)
    # a calibration that fitted much longer responses at one corner makes that corner the worst everywhere
    data = yaml.safe_load(profile.read_text())
    label = Corner(1.4, 0.15).label
    data["calibration"] = {"corners": [{"label": label, "length_median": 2000}]}
    fitted = tmp_path / "fitted.yaml"
    fitted.write_text(yaml.safe_dump(data))
    again = plan(fitted, 4, staleness=(1,), **size)  # type: ignore[arg-type]
    assert {r["worst_corner"] for r in again} == {label}
    assert min(r["worst_s_per_step"] for r in again) > max(worst)


def test_weir_twin_calibrate_writes_the_predictions_and_the_corners(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = short_profile(tmp_path / "p.yaml", max_response_tokens=1024, length_median=100)
    data = yaml.safe_load(profile.read_text())  # a published colocate step this short profile can meet, on 4 GPUs
    target = colocate_cost_model(profile, 4, prompts=4, n=2, steps=2)["s_per_step"] * 1.1
    for name, value in {"colocate_s_per_step": target, "gpus": 4, "prompts": 4, "n": 2}.items():
        data["reference"][name]["value"] = value
    profile.write_text(yaml.safe_dump(data))
    out, predictions = tmp_path / "cal.yaml", tmp_path / "predictions.json"
    args = ["twin", "calibrate", "--profile", str(profile), "--model-steps", "2", "--out", str(out)]
    assert main([*args, "--predictions", str(predictions), "--home", str(tmp_path / "h")]) == 0
    printed = capsys.readouterr().out
    assert "Held out" in printed and "one-step-off" in printed and str(predictions) in printed
    held = json.loads(predictions.read_text())
    fitted = yaml.safe_load(out.read_text())["calibration"]
    assert [c["label"] for c in fitted["corners"]] == [c["label"] for c in held["corners"]]
    assert fitted["value"] == held["corners"][0]["fit"]["value"] == SimProfile.load(out).length_median
    assert main(["twin", "--cost-model", "--profile", str(profile), "--gpus", "4", "--modes", "one-step-off",
                 "--n", "2", "--prompts-per-step", "2", "--model-steps", "2"]) == 0  # fmt: skip
    assert "one-step-off 2:2" in capsys.readouterr().out


def test_calibration_reaches_exactly_eight_times_either_way(tmp_path: Path) -> None:
    """A target met by the last outward step is taken (not stepped past), x8 itself is reached, and past it the
    target is refused with the s/step the knob's range gives."""
    profile = short_profile(tmp_path / "p.yaml", max_response_tokens=4096)

    def at(value: float) -> float:
        changed = {"length_median": value}
        return colocate_cost_model(profile, 2, prompts=4, n=4, steps=2, overrides=changed)["s_per_step"]

    size = {"gpus": 2, "prompts": 4, "n": 4, "steps": 2}
    near = calibrate(profile, target_s=at(60 * 1.5**5) * 1.001, **size)  # type: ignore[arg-type]
    assert near["value"] == pytest.approx(60 * 1.5**5, rel=1e-3)
    end = calibrate(profile, target_s=at(480) * 0.999, **size)  # type: ignore[arg-type]
    assert end["s_per_step"] == pytest.approx(at(480) * 0.999, rel=0.002)
    with pytest.raises(ValueError, match="from 7.5 to 480"):
        calibrate(profile, target_s=at(480) * 1.2, **size)  # type: ignore[arg-type]
