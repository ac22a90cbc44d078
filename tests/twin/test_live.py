"""`weir twin`: a tiny capacity twin (2 sim engines, 3 steps, a high compression) runs the real stack and the
real RL loop end to end; the control-plane arithmetic and the table's speed-ups are checked on their own."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from engines import GenerateRequest, SamplingParams
from engines.sim_backend import SimEngine, SimProfile
from launcher.cli import build_parser
from launcher.stack import LocalStack
from tests.ports import free_stack_base
from twin.config import TwinConfig
from twin.live import (
    cost_model_step,
    dapo_like_rows,
    data_role_load,
    layout,
    parse_mode,
    run_twin,
)
from twin.report import control_plane, plot_twin, summary, twin_table

RELAX = Path(__file__).resolve().parents[2] / "profiles" / "relax-qwen3-4b-h800.yaml"


def _short_profile(path: Path) -> Path:
    """Relax's profile with short responses (the control plane then costs little); every other constant kept."""
    data = yaml.safe_load(RELAX.read_text())
    data["constants"]["length_median"]["value"] = 40
    data["constants"]["max_response_tokens"]["value"] = 128
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_tiny_twin_runs_end_to_end(tmp_path: Path) -> None:
    """One node of 2 GPUs: one sim engine process of 2 replicas, colocate then async on-policy (staleness 0)."""
    config = TwinConfig(
        profile=_short_profile(tmp_path / "short.yaml"),
        nodes=(1,),
        gpus_per_node=2,
        steps=3,
        prompts_per_step=2,
        n=4,
        compressions=(1000.0,),
        modes=("colocate", "async-0"),
        home=tmp_path / "twin",
        base_port=free_stack_base(1),
        prompts=8,
    )
    out = run_twin(config, new_stack=LocalStack)
    colocate, on_policy = out["rows"]
    assert colocate["mode"] == "colocate" and colocate["engines"] == 2 and colocate["processes"] == 1
    assert colocate["steps"] == 3 and colocate["samples_per_step"] == 8 and colocate["tokens_per_step"] > 0
    assert colocate["sim_s_per_step"] == pytest.approx(colocate["wall_s_per_step"] * 1000.0)
    # the trainer's own accounting: weight sync + the colocate swap (2+2 engine, 1+1 trainer) + training + optimizer
    assert colocate["trainer_sim_s_per_step"] > 1.0 + 6.0 + colocate["trainer_optimizer_s_per_step"]
    assert colocate["trainer_allreduce_s_per_step"] == 0.0  # 2 GPUs at TP=2: one data-parallel rank
    assert 0 < colocate["trainer_optimizer_s_per_step"] < 0.1  # 2.01e9 params x 28 B / (3.35 TB/s x 70%)
    assert colocate["speedup"] == pytest.approx(1.0) and colocate["linearity"] is None  # one size only
    assert colocate["staleness_histogram"] == {"0": 24}  # colocate trains only what the current policy made
    assert on_policy["engines"] == 1 and on_policy["trainer_gpus"] == 1
    assert set(on_policy["staleness_histogram"]) == {"0"}  # staleness 0: anything older was dropped
    for row in out["rows"]:  # the data role's load, read from its /metrics
        assert row["data"]["groups"] >= 6 and row["data"]["ack_requests"] >= 3  # a step's in one request
        assert row["data"]["microbatches"] >= 3 and row["data_microbatches_per_wall_s"] > 0
        assert row["data"]["ingest_p99_ms"] is not None and row["data_groups_per_wall_s"] > 0
    assert "colocate_error" in out["calibration"] and "async-0_speedup" in out["calibration"]
    assert json.loads((config.home / "results.json").read_text())["rows"][0]["mode"] == "colocate"
    assert plot_twin(out, tmp_path / "twin.png").stat().st_size > 10_000


def test_layouts_scale_engines_and_trainer_together() -> None:
    one = layout(8, "colocate")
    assert (one.engines, one.trainer_gpus, one.processes, one.replicas) == (8, 8, 1, 8)
    eight = layout(64, "async-1")
    assert (eight.engines, eight.trainer_gpus, eight.processes, eight.replicas) == (32, 32, 8, 4)
    small = layout(2, "async-1")  # under a node: an engine process each
    assert (small.engines, small.trainer_gpus, small.processes, small.replicas) == (1, 1, 1, 1)
    assert parse_mode("colocate") == (True, None, False)
    assert parse_mode("async-0") == (False, 0, False) and parse_mode("partial-2") == (False, 2, True)
    with pytest.raises(ValueError, match="unknown twin mode"):
        parse_mode("async-x")


def test_the_cost_model_alone_gives_a_colocate_step(tmp_path: Path) -> None:
    """No stack: generation as long as the busiest engine's simulated time, then the trainer's costs."""
    profile = _short_profile(tmp_path / "short.yaml")
    out = cost_model_step(profile, 4, prompts=4, n=4, steps=3)
    trainer = yaml.safe_load(profile.read_text())["trainer"]
    engine = yaml.safe_load(profile.read_text())["constants"]
    swap = sum(engine[k]["value"] for k in ("sleep_s", "wake_s")) + sum(
        trainer[k]["value"] for k in ("onload_s", "offload_s")
    )
    fixed = swap + out["allreduce_s"] + out["optimizer_s"] + trainer["weight_sync_broadcast_s"]["value"]
    assert out["allreduce_s"] > 0 and out["optimizer_s"] > 0  # 4 GPUs at TP=2: two data-parallel ranks
    assert out["fixed_s"] == pytest.approx(fixed + engine["weight_update_s"]["value"])
    train = out["tokens_per_step"] / (4 * trainer["train_tokens_per_gpu_s"]["value"])
    assert out["s_per_step"] == pytest.approx(out["generation_s"] + out["fixed_s"] + train)
    assert 0 < out["generation_s"] < 128 * 0.05  # at most 128 decode steps of a small batch
    with pytest.raises(ValueError, match="colocate"):
        cost_model_step(profile, 4, "async-1")


def test_the_data_roles_load_is_read_from_its_metrics() -> None:
    text = "\n".join(
        [
            "# TYPE weir_http_request_seconds histogram",
            *(
                f'weir_http_request_seconds_bucket{{le="{le}",route="/v1/experience"}} {count}'
                for le, count in (("0.05", 90), ("0.1", 98), ("0.25", 100), ("+Inf", 100))
            ),
            'weir_http_request_seconds_count{route="/v1/experience"} 100',
            'weir_http_request_seconds_sum{route="/v1/experience"} 3.0',
            *(
                f'weir_http_request_seconds_bucket{{le="{le}",route="{route}"}} {count}'
                for route in ("/v1/microbatches/ack", "/v1/microbatches/{batch_id}/ack")
                for le, count in (("0.05", 4), ("0.1", 5), ("+Inf", 5))
            ),
            "# TYPE weir_data_groups_stored counter",
            "weir_data_groups_stored_total 100",
            "# TYPE weir_data_microbatches_delivered counter",
            "weir_data_microbatches_delivered_total 12",
        ]
    )
    load = data_role_load(text + "\n")
    assert load["groups"] == 100 and load["ingest_requests"] == 100
    assert load["ingest_p99_ms"] == pytest.approx(250.0)  # the bucket the 99th request falls in
    assert load["ack_requests"] == 10 and load["ack_p99_ms"] == pytest.approx(100.0)  # both routes' buckets summed
    assert load["microbatches"] == 12


def test_control_plane_share_from_two_compressions() -> None:
    gpu, plane = 200.0, 0.5  # simulated s/step, wall s/step of real control-plane work
    runs = [
        {"mode": m, "compression": c, "wall_s_per_step": gpu / c + plane, "sim_s_per_step": (gpu / c + plane) * c}
        for m, c in (("colocate", 10.0), ("colocate", 50.0))
    ]
    found = control_plane(runs[0], runs[1])
    assert found["gpu_sim_s"] == pytest.approx(gpu) and found["plane_wall_s"] == pytest.approx(plane)
    assert found["plane_share_high"] == pytest.approx(0.5 / 4.5) and found["moved"] > 0.05
    third = {"mode": "colocate", "compression": 20.0, "wall_s_per_step": gpu / 20 + plane + 0.3}
    third["sim_s_per_step"] = third["wall_s_per_step"] * 20
    fitted = control_plane(runs[1], third, runs[0])  # least squares over three factors, any order
    assert fitted["gpu_sim_s"] == pytest.approx(gpu, rel=0.05) and fitted["plane_wall_s"] == pytest.approx(0.6, abs=0.1)


def test_the_decomposition_is_per_token_when_two_runs_trained_different_work() -> None:
    """Two factors whose steps happened to hold 10 % different tokens: per step the simulated time moved 10 %,
    per token not at all (no control plane) — GPU-bound, and S is per step of the runs' mean tokens."""
    runs = [
        {"mode": "async-1", "compression": c, "tokens_per_step": t, "wall_s_per_step": 1e-4 * t / c,
         "sim_s_per_step": 1e-4 * t}
        for c, t in ((2.0, 1.0e6), (4.0, 1.1e6))
    ]  # fmt: skip
    found = control_plane(*runs)
    assert found["moved"] == pytest.approx(0.1) and found["moved_per_token"] == pytest.approx(0.0, abs=1e-9)
    assert found["gpu_sim_s"] == pytest.approx(105.0) and found["plane_wall_s"] == pytest.approx(0.0, abs=1e-9)


def test_linearity_across_sizes_is_by_the_gpu_bound_runs() -> None:
    """At each size the runs within 5 % per token of the lowest factor's give the GPU time; a factor where the
    control plane limits the run (32 GPUs at c = 4 here: 25 % slower per token) is left out, so the control
    plane's wall time does not count against the cluster; a size where no two factors agree is left out."""
    runs: list[dict[str, Any]] = []
    for gpus, gpu_s, plane, tokens in ((8, 150.0, 0.0, 8e5), (32, 160.0, 10.0, 3.2e6)):
        for c in (1.0, 2.0, 4.0):
            wall = gpu_s / c + plane * (c == 4.0)
            per_gpu = tokens / wall / c / gpus
            runs.append(
                {"mode": "async-1", "gpus": gpus, "compression": c, "wall_s_per_step": wall,
                 "sim_s_per_step": wall * c, "tokens_per_step": tokens, "tokens_per_s_per_gpu": per_gpu}
            )  # fmt: skip
    config = TwinConfig(profile=RELAX, nodes=(1, 4))
    one_factor = [r for r in runs if r["gpus"] == 8 or r["compression"] != 2.0]  # 32 GPUs: c = 1 and 4 disagree
    assert "async-1" not in summary(one_factor, config)["scaling"]
    points = summary(runs, config)["scaling"]["async-1"]
    assert [p["gpus"] for p in points] == [8, 32]
    assert points[0]["gpu_sim_s"] == pytest.approx(150.0) and points[1]["gpu_sim_s"] == pytest.approx(160.0)
    assert points[0]["factors"] == [1.0, 2.0, 4.0] and points[1]["left_out"] == [4.0]
    assert points[1]["linearity"] == pytest.approx(150.0 / 160.0)  # 4x the tokens on 4x the GPUs, 160 s not 150


def test_speedups_are_over_colocate_at_the_same_compression() -> None:
    results: list[dict[str, Any]] = [
        {"mode": "colocate", "compression": 10.0, "sim_s_per_step": 200.0, "gpus": 8, "tokens_per_s_per_gpu": 100.0},
        {"mode": "async-1", "compression": 10.0, "sim_s_per_step": 100.0, "gpus": 8, "tokens_per_s_per_gpu": 200.0},
        {"mode": "async-1", "compression": 50.0, "sim_s_per_step": 120.0, "gpus": 8, "tokens_per_s_per_gpu": 170.0},
        {"mode": "async-1", "compression": 10.0, "sim_s_per_step": 110.0, "gpus": 32, "tokens_per_s_per_gpu": 180.0},
    ]
    rows = twin_table(results)
    assert [r["speedup"] for r in rows] == [1.0, 2.0, None, None]  # no colocate at 32 GPUs, nor at 50x
    assert [r["linearity"] for r in rows] == [None, 1.0, None, pytest.approx(0.9)]  # vs the mode's fewest GPUs


def test_prompts_scale_and_the_cli_parses() -> None:
    assert TwinConfig(gpus=16).prompts_for_step() == 32 and TwinConfig(gpus=2).prompts_for_step() == 4
    assert TwinConfig(nodes=(1, 4)).gpu_counts() == [8, 32] and TwinConfig().prompts_for_step(64) == 128
    rows = dapo_like_rows(3)
    assert len({r["messages"][0]["content"] for r in rows}) == 3 and all(
        "Answer:" in r["messages"][0]["content"] for r in rows
    )
    args = build_parser().parse_args(["twin", "--gpus", "2", "--compression", "10", "50", "--modes", "colocate"])
    assert args.gpus == 2 and args.compression == [10.0, 50.0] and args.modes == ["colocate"]
    args = build_parser().parse_args(["twin", "--nodes", "1", "2", "4", "8", "--modes", "async-0", "partial-1"])
    assert args.nodes == [1, 2, 4, 8] and args.gpus_per_node == 8 and args.modes == ["async-0", "partial-1"]


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


def test_weir_twin_stopped_by_sigterm_stops_its_stack(tmp_path: Path) -> None:
    """A live twin killed by SIGTERM (a scheduler, `timeout`) exits 130 and leaves no role running: before, its
    stack (32 engine processes at 256 GPUs) kept running after the twin was gone."""
    import signal
    import subprocess
    import sys
    import time

    from tests.benchmarks.soak import _role_pids

    base = free_stack_base(1)
    command = [sys.executable, "-m", "launcher.cli", "twin", "--gpus", "2", "--steps", "1000", "--compression", "100"]
    command += ["--modes", "async-1", "--profile", str(_short_profile(tmp_path / "short.yaml"))]
    command += ["--home", str(tmp_path / "twin"), "--base-port", str(base)]
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    metrics = tmp_path / "twin" / "g2" / "c100" / "async-1" / "train" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 300
        while not (metrics.is_file() and metrics.read_text().strip()) and run.poll() is None:
            assert time.monotonic() < deadline, "the twin's first step did not finish"
            time.sleep(0.5)
        assert run.poll() is None, run.communicate()[1][-3000:]
        run.send_signal(signal.SIGTERM)
        _, err = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 130, err[-3000:]
    assert b"Traceback" not in err and b"interrupted" in err
    assert not _role_pids(base)  # every role process is gone
