"""`weir twin`: a tiny capacity twin (2 sim engines, 3 steps, a high compression) runs the real stack and the
real RL loop end to end; the control-plane arithmetic and the table's speed-ups are checked on their own."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import yaml

from engines import GenerateRequest, SamplingParams
from engines.sim_backend import SimEngine, SimProfile
from services.cli import build_parser
from services.stack import _port_in_use, stack_ports
from services.twin import TwinConfig, control_plane, dapo_like_rows, run_twin, twin_table

RELAX = Path(__file__).resolve().parents[2] / "profiles" / "relax-qwen3-4b-h800.yaml"


def _free_base(engines: int) -> int:
    for _ in range(50):
        base = random.randrange(10_000, 30_000, 10)
        if not any(_port_in_use("127.0.0.1", port) for _, _, port in stack_ports(base, engines)):
            return base
    raise RuntimeError("no free base port")


def _short_profile(path: Path) -> Path:
    """Relax's profile with short responses (the control plane then costs little); every other constant kept."""
    data = yaml.safe_load(RELAX.read_text())
    data["constants"]["length_median"]["value"] = 40
    data["constants"]["max_response_tokens"]["value"] = 128
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_tiny_twin_runs_end_to_end(tmp_path: Path) -> None:
    config = TwinConfig(
        profile=_short_profile(tmp_path / "short.yaml"),
        gpus=2,
        steps=3,
        prompts_per_step=2,
        n=4,
        compressions=(1000.0,),
        modes=("colocate",),
        home=tmp_path / "twin",
        base_port=_free_base(2),
        prompts=8,
    )
    out = run_twin(config)
    (row,) = out["rows"]
    assert row["mode"] == "colocate" and row["engines"] == 2 and row["steps"] == 3
    assert row["samples_per_step"] == 8 and row["tokens_per_step"] > 0
    assert row["sim_s_per_step"] == pytest.approx(row["wall_s_per_step"] * 1000.0)
    # the trainer's own accounting: optimizer + weight sync + the colocate swap (2+2 engine, 1+1 trainer) + training
    assert row["trainer_sim_s_per_step"] > 1.0 + 1.0 + 6.0
    assert row["speedup"] == pytest.approx(1.0) and row["dropped_stale"] == 0
    assert "colocate_error" in out["calibration"]
    assert json.loads((config.home / "results.json").read_text())["rows"][0]["mode"] == "colocate"


def test_control_plane_share_from_two_compressions() -> None:
    gpu, plane = 200.0, 0.5  # simulated s/step, wall s/step of real control-plane work
    runs = [
        {"mode": m, "compression": c, "wall_s_per_step": gpu / c + plane, "sim_s_per_step": (gpu / c + plane) * c}
        for m, c in (("colocate", 10.0), ("colocate", 50.0))
    ]
    found = control_plane(runs[0], runs[1])
    assert found["gpu_sim_s"] == pytest.approx(gpu) and found["plane_wall_s"] == pytest.approx(plane)
    assert found["plane_share_high"] == pytest.approx(0.5 / 4.5) and found["moved"] > 0.05


def test_speedups_are_over_colocate_at_the_same_compression() -> None:
    results: list[dict[str, Any]] = [
        {"mode": "colocate", "compression": 10.0, "sim_s_per_step": 200.0},
        {"mode": "async-1", "compression": 10.0, "sim_s_per_step": 100.0},
        {"mode": "async-1", "compression": 50.0, "sim_s_per_step": 120.0},
    ]
    assert [r["speedup"] for r in twin_table(results)] == [1.0, 2.0, None]


def test_prompts_scale_and_the_cli_parses() -> None:
    assert TwinConfig(gpus=16).prompts_for_step() == 32 and TwinConfig(gpus=2).prompts_for_step() == 4
    rows = dapo_like_rows(3)
    assert len({r["messages"][0]["content"] for r in rows}) == 3 and all(
        "Answer:" in r["messages"][0]["content"] for r in rows
    )
    args = build_parser().parse_args(["twin", "--gpus", "2", "--compression", "10", "50", "--modes", "colocate"])
    assert args.gpus == 2 and args.compression == [10.0, 50.0] and args.modes == ["colocate"]


def _constants(**overrides: Any) -> dict[str, Any]:
    data = yaml.safe_load(RELAX.read_text())
    data["constants"].update({k: {"value": v, "source": "test"} for k, v in overrides.items()})
    data["constants"]["compression"]["value"] = 1e6
    return dict(data)


def test_length_seed_prompt_draws_the_same_lengths_in_every_run() -> None:
    """With length_seed "prompt", unseeded requests draw from (prompt, occurrence): two engines given the same
    prompts in the same order draw the same lengths, whatever the rids; repeats of a prompt differ."""
    lengths = []
    for _ in range(2):
        engine = SimEngine(SimProfile.from_dict(_constants(length_seed="prompt", length_median=50)))
        try:
            results = [
                engine.generate(
                    GenerateRequest(input_ids=[1, 2, p], sampling=SamplingParams(max_new_tokens=2000)), timeout=30
                )
                for p in (3, 3, 3, 4)
            ]
        finally:
            engine.close()
        lengths.append([len(r.output_ids) for r in results])
    assert lengths[0] == lengths[1]
    assert len(set(lengths[0][:3])) > 1  # occurrences of one prompt draw differently
    with pytest.raises(ValueError, match="length_seed"):
        SimProfile.from_dict(_constants(length_seed="dice"))
