"""The demo task, the warm-up, the plot, and `weir train --demo` end to end (a few steps)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from encoders.embedded_model import init_model
from launcher.cli import main
from launcher.demo.plot import plot_runs
from launcher.demo.task import COLOURS, colour_picture, warmup_prompts, write_demo_task
from tests.ports import free_stack_base
from trainer.reference import ReferenceTrainer


def test_pictures_are_the_colour_they_are_named_and_all_different(tmp_path: Path) -> None:
    train, held_out = write_demo_task(tmp_path)
    assert len(train) == 64 and len(held_out) == 16
    assert [r["reward"]["answer"] for r in train[:4]] == list(COLOURS)  # balanced from the first rows
    for row in train[:4] + held_out[:4]:
        path = Path(row["messages"][0]["content"][0]["image_url"]["url"])
        pixels = np.asarray(Image.open(path).convert("RGB")).reshape(-1, 3).astype(int)
        target = np.array(COLOURS[row["reward"]["answer"]])
        assert np.median(np.abs(pixels - target).sum(1)) < 60 and Image.open(path).size == (56, 56)
    paths = {r["messages"][0]["content"][0]["image_url"]["url"] for r in train + held_out}
    assert len(paths) == 80 and len({Path(p).read_bytes() for p in paths}) == 80
    assert Image.open(io.BytesIO(colour_picture("red", 1))).format == "PNG"


def test_the_text_only_warm_up_teaches_the_answer_format(tmp_path: Path) -> None:
    trainer = ReferenceTrainer(init_model(tmp_path / "model"), lr=1e-3)
    pairs = [trainer.chat_pair(messages, answer) for messages, answer in warmup_prompts()]
    assert all(response[-1] == trainer.tokenizer.convert_tokens_to_ids("<|im_end|>") for _, response, _ in pairs)
    losses = [trainer.supervised_step(pairs, lr=3e-3) for _ in range(30)]
    assert losses[-1] < 0.5 * losses[0]


def test_the_plot_overlays_runs(tmp_path: Path) -> None:
    records = [{"time_s": t, "mean_reward": t / 10, "samples_per_s": 5.0} for t in range(10)]
    path = plot_runs({"async": records, "colocate": records[:5]}, tmp_path / "p" / "reward.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.integration
def test_weir_train_demo_runs_warm_up_loop_checks_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    home = tmp_path / "weir"
    argv = ["train", "--demo", "--home", str(home), "--steps", "2", "--warmup-steps", "2"]
    assert main([*argv, "--base-port", str(free_stack_base())]) == 0
    out = capsys.readouterr().out
    assert "Greedy accuracy on 16 held-out pictures before RL" in out and "Training summary" in out
    assert "memory per rank (estimate)" in out  # printed before the first step
    lines = (home / "train" / "async" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    assert json.loads(lines[0])["samples"] == 64  # 8 groups × n=8: one optimizer step
    assert json.loads(lines[0])["mismatch/on_policy/kl"] < 1e-3  # the engine's log-probs, recomputed by the trainer
    assert (home / "train" / "async" / "reward.png").is_file()


@pytest.mark.integration
@pytest.mark.parametrize(
    ("arch", "options"),
    [
        ("qwen3", []),
        ("qwen3-moe", ["--trainer", "megatron"]),
        ("qwen2.5-vl", ["--trainer", "megatron"]),  # pictures through Megatron's splice and 3-D positions
        ("qwen3-vl-moe", ["--r3"]),  # routing replay: the engine's experts replayed in the trainer
        ("qwen3.5", []),
        ("qwen3.5", ["--trainer", "megatron"]),  # its delta-net layers on megatron-core (`trainer.megatron.delta_net`)
    ],
)
def test_weir_train_demo_runs_on_every_new_family(
    arch: str, options: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`weir train --demo --arch A` through the whole stack, one step, whose log-probs the trainer recomputes as the
    engine gave them (the full runs that learn are ``slow``:
    `tests/trainer/test_families_learning.py`). A text model's demo is the colour-word task: its preprocess and
    encoder roles start and are never given an item (nothing cached)."""
    home = tmp_path / "weir"
    argv = ["train", "--demo", "--arch", arch, *options, "--home", str(home)]
    assert main([*argv, "--steps", "1", "--warmup-steps", "1", "--base-port", str(free_stack_base())]) == 0
    out = capsys.readouterr().out
    text = arch in ("qwen3", "qwen3-moe")
    assert f"Greedy accuracy on 16 held-out {'lines' if text else 'pictures'} before RL" in out
    assert "Training summary" in out
    lines = (home / "train" / "async" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1]
    # The first step is on-policy: the engine's log-probs and the trainer's agree at fp32's error (issue #39, item 5)
    first = json.loads(lines[0])
    assert first["mismatch/on_policy/tokens"] > 0 and first["mismatch/on_policy/kl"] < 1e-3, first
    # Every publish went by broadcast (a fall-back to disk writes a model folder, weights/vN/config.json; a broadcast
    # writes at most the towers for the encoder role): a MoE model's experts included, which the Megatron trainer
    # names one by one, as Qwen3-MoE's files do, and the engine fuses (`engines.checkpoint_layout`)
    assert not list((home / "train" / "async").glob("weights/v*/config.json")), "the weights fell back to disk"
    if text:  # no media: no feature or embedding was written
        assert not list((home / "cache").rglob("*.arrow"))


@pytest.mark.integration
def test_weir_train_attaches_to_a_running_stack_and_compares_modes(tmp_path: Path) -> None:
    from launcher.stack import LocalStack

    home = tmp_path / "weir"
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text(
        json.dumps(
            {"messages": [{"role": "user", "content": "Say yes."}], "reward": {"type": "exact_match", "answer": "yes"}}
        )
        + "\n"
    )
    stack = LocalStack(home=home, base_port=free_stack_base())
    stack.start()
    try:
        common = ["--dataset", str(dataset), "--attach", "--home", str(home), "--steps", "1", "--max-new-tokens", "3"]
        common += ["--base-port", str(stack.base_port)]
        assert main(["train", *common, "--mode", "async"]) == 0
        assert main(["train", *common, "--mode", "colocate"]) == 0
        assert all(c.process.poll() is None for c in stack.children)  # attached: nothing was stopped
    finally:
        stack.stop()
    assert (home / "train" / "compare.png").read_bytes()[:4] == b"\x89PNG"
