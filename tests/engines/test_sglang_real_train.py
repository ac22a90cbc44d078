"""``weir train --backend sglang``: the RL loop with the real SGLang engine (sglang 0.5.23) as the stack's engine
role, on the CPU (each engine role prepared by the ``sitecustomize`` of `tests.engines.sglang_cpu.role_env`), and
what it refuses before anything starts.

Runs where sglang is installed (``make test`` runs it in ``.venv-sglang``; skipped, with the reason, elsewhere).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("needs sglang: `make test` builds .venv-sglang and runs this module there", allow_module_level=True)

from tests.ports import free_stack_base  # noqa: E402

from . import sglang_cpu  # noqa: E402

pytestmark = pytest.mark.integration

CPU_ARGS = json.dumps(sglang_cpu.SERVER_ARGS)
HYBRID_ARGS = json.dumps(sglang_cpu.HYBRID_SERVER_ARGS)  # Qwen3.5 (its linear-attention layers' state pool)


def _weir(*argv: str, timeout: float, scaffold: bool = True) -> subprocess.CompletedProcess[str]:
    """``weir ARGV`` in a process of its own, under the CPU scaffolding (``scaffold=False``: as SGLang is installed,
    its capture of routes pinning memory it cannot pin here)."""
    env = {**os.environ, **sglang_cpu.role_env()}
    if not scaffold:
        del env["WEIR_SGLANG_CPU_SCAFFOLD"]
    command = [sys.executable, "-m", "launcher.cli", *argv]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("arch", [None, "qwen3", "qwen2.5-vl", "qwen3.5"])
def test_weir_train_runs_the_demo_with_sglang_engines(tmp_path: Path, arch: str | None) -> None:
    """Two RL steps of the demo served by SGLang — its default model (a Qwen3-VL, which SGLang serves natively), a
    text model (Qwen3: the colour-word task), Qwen2.5-VL (whose module names are not its checkpoint's) and Qwen3.5
    (its gated delta-net layers on the scaffolding's stand-in kernels) —: every
    sample trained, the weights broadcast to SGLang (retract, update, continue) between steps, never falling back to
    disk, and SGLang's log-probs the trainer's (the mismatch monitor's KL under 1e-3; its banned media tokens' mass
    aside: `engines.sglang_request.build_request`)."""
    home = tmp_path / "home"
    args = HYBRID_ARGS if arch == "qwen3.5" else CPU_ARGS
    argv = ["train", "--demo", *(["--arch", arch] if arch else []), "--backend", "sglang", "--sglang-args", args]
    argv += ["--steps", "2", "--warmup-steps", "1", "--home", str(home), "--base-port", str(free_stack_base(1))]
    done = _weir(*argv, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "weights by broadcast stop" not in done.stdout + done.stderr  # Qwen2.5-VL's names, as SGLang loads them
    steps = [json.loads(line) for line in (home / "train" / "async" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2] and all(s["samples"] > 0 for s in steps)
    assert steps[-1]["policy_version"] >= 2  # published to the engine, which generated under it
    assert all(s["mismatch/all/kl"] < 1e-3 for s in steps)
    (log,) = (home / "logs").glob("engine-*.log")
    assert "sglang.srt" in log.read_text()  # the engine role ran SGLang


@pytest.mark.parametrize(("arch", "r3"), [("qwen3-moe", True), ("qwen3-vl-moe", False)])
def test_a_moe_demo_runs_on_sglang_with_its_routes_and_broadcasts_the_files_layout(
    tmp_path: Path, arch: str, r3: bool
) -> None:
    """A MoE demo on SGLang on the CPU: the engine returns each token's experts (SGLang's own capture, its host
    buffer unpinned by `tests.engines.sglang_cpu`), which the trainer replays with ``--r3`` (Qwen3-MoE) or only
    compares with its own routers (the mismatch monitor's routing agreement; Qwen3-VL-MoE); its weights by
    broadcast as the model's files hold them (Qwen3-MoE's experts one by one, Qwen3-VL-MoE's fused and
    transposed), said at the join — transformers' module holds them otherwise, which SGLang's loader cannot take
    (the role refuses that layout: `tests/engines/test_sglang_engine.py`) —, loaded by SGLang's own loaders: the
    engine's log-probs the trainer's after every publish."""
    home = tmp_path / "home"
    argv = ["train", "--demo", "--arch", arch, "--backend", "sglang", "--sglang-args", CPU_ARGS, *(["--r3"] * r3)]
    argv += ["--steps", "2", "--warmup-steps", "1", "--home", str(home), "--base-port", str(free_stack_base(1))]
    done = _weir(*argv, timeout=1200)
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-6000:]
    assert "weights by broadcast stop" not in said  # no fall-back to disk
    steps = [json.loads(line) for line in (home / "train" / "async" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2] and steps[-1]["policy_version"] >= 2
    assert all(s["mismatch/all/kl"] < 1e-3 for s in steps)
    # the trained samples came with the engine's experts (replayed with --r3), and on the first, on-policy, step the
    # trainer's own routers chose them (the monitor compares its routers' choices, replayed or not)
    assert all(s["mismatch/routing/pairs"] > 0 for s in steps)
    assert steps[0]["mismatch/routing/agreement"] > 0.9, steps[0]
    (log,) = (home / "logs").glob("engine-*.log")
    assert "Failed to update parameter online" not in log.read_text()  # nothing sent SGLang could not load


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3-moe", "qwen3-vl-moe", "qwen3.5"])
def test_a_demo_learns_on_sglang(tmp_path: Path, arch: str) -> None:
    """The whole demo (150 steps) on the real SGLang engine, the MoE families with ``--r3``: held-out greedy
    accuracy to 80 % or more (measured: Qwen3-MoE 25 % → 100 %, 216 s; Qwen3-VL-MoE 25 % → 100 %, 388 s; the
    figures, Qwen3.5's with them, in `docs/training.md#families`)."""
    home = tmp_path / "home"
    moe = arch != "qwen3.5"
    argv = ["train", "--demo", "--arch", arch, "--backend", "sglang", "--sglang-args", CPU_ARGS if moe else HYBRID_ARGS]
    argv += ["--r3"] * moe
    done = _weir(*argv, "--home", str(home), "--base-port", str(free_stack_base(1)), timeout=5400)
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-6000:]
    found = re.search(r"greedy accuracy on held-out \w+\D+(\d+)% → (\d+)%", done.stdout)
    assert found is not None, said[-3000:]
    before, after = (int(v) for v in found.groups())
    assert after >= 80 and after > before, said[-3000:]


@pytest.mark.parametrize(
    ("options", "refusal"),
    [
        (
            ["--arch", "qwen2.5-omni"],
            "--backend sglang: the model is a Qwen2_5OmniThinkerForConditionalGeneration, which the installed SGLang",
        ),
        (["--arch", "qwen3-vl", "--sglang-args", '{"tp_sise": 2}'], "tp_sise: not a server argument of this SGLang"),
        (["--arch", "qwen3-vl", "--sglang-args", "[1]"], "SGLang server arguments must be a JSON object"),
        (["--arch", "qwen3-vl", "--attach"], "with --attach the stack's engines are its own"),
    ],
)
def test_what_sglang_cannot_serve_is_refused_in_one_line_before_anything_starts(
    tmp_path: Path, options: list[str], refusal: str
) -> None:
    done = _weir("train", "--demo", "--backend", "sglang", "--home", str(tmp_path / "home"), *options, timeout=120)
    assert done.returncode == 2 and refusal in done.stdout + done.stderr, done.stdout + done.stderr
    assert not (tmp_path / "home" / "logs").exists()  # no role started


def test_r3_is_refused_where_the_installed_sglang_cannot_return_routes_on_the_cpu(tmp_path: Path) -> None:
    """SGLang 0.5.23 as installed pins its buffer of routes with ``cudaHostRegister``: on the CPU that engine would
    not start, so ``--r3`` is refused before anything starts (`engines.sglang_args.routes_on_cpu` reads SGLang's own
    allocation table; under the scaffolding, which leaves the buffer unpinned, the same run trains: above)."""
    home = tmp_path / "home"
    options = ["--arch", "qwen3-moe", "--r3", "--sglang-args", CPU_ARGS, "--home", str(home)]
    done = _weir("train", "--demo", "--backend", "sglang", *options, timeout=300, scaffold=False)
    assert done.returncode == 2 and "--r3 with SGLang on the CPU" in done.stdout + done.stderr, done.stderr[-3000:]
    assert not (home / "logs").exists()


def test_a_linear_attention_model_is_refused_where_sgl_kernel_lacks_its_cpu_ops(tmp_path: Path) -> None:
    """SGLang's Qwen3.5 on the CPU calls sgl-kernel ops its CPU build alone has (PyPI's CUDA wheel, installed here,
    has none; its scheduler would fail at start): refused before anything starts (`engines.sglang_args.
    linear_attention_on_cpu`; under the scaffolding, whose stand-ins are those ops, the same run trains: above)."""
    home = tmp_path / "home"
    options = ["--arch", "qwen3.5", "--sglang-args", HYBRID_ARGS, "--home", str(home)]
    done = _weir("train", "--demo", "--backend", "sglang", *options, timeout=300, scaffold=False)
    said = done.stdout + done.stderr
    assert done.returncode == 2 and "linear-attention layers (gated delta-nets) run on sgl-kernel" in said, said[-3000:]
    assert not (home / "logs").exists()
