"""Text models (Qwen3, Qwen3-MoE) through the stack: their demo is the parity task; the media roles start for them
and refuse any item by name (nothing cached); a picture task on a text model is refused before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from encoders.embedded_model import init_model
from encoders.errors import NoTower
from encoders.towers import Towers
from launcher.config import TrainConfig
from launcher.demo.task import write_parity_task
from launcher.model import demo_refusal
from preprocess import samples


@pytest.fixture(scope="module")
def text_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("qwen3") / "model", arch="qwen3")


def test_the_parity_task_is_balanced_deterministic_and_holds_out_unseen_numbers() -> None:
    rows, held_out = write_parity_task()
    assert (len(rows), len(held_out)) == (64, 16)
    assert write_parity_task() == (rows, held_out)
    answers = [row["reward"]["answer"] for row in rows]
    assert answers[:4] == ["even", "odd", "even", "odd"] and answers.count("even") == 32

    def number(row: dict) -> int:
        return int(row["messages"][0]["content"].split()[1])

    assert not {number(r) for r in rows} & {number(r) for r in held_out}
    for row in rows + held_out:
        assert row["reward"]["answer"] == ("even" if number(row) % 2 == 0 else "odd")


def test_a_text_arch_s_demo_is_the_parity_task() -> None:
    assert TrainConfig.with_defaults(demo=True, arch="qwen3", demo_task=None).demo_task == "parity"
    assert TrainConfig.with_defaults(demo=True, arch="qwen3-vl", demo_task=None).demo_task == "colours"
    assert TrainConfig.with_defaults(demo=False, arch="qwen3", demo_task=None).demo_task == "colours"


def test_a_picture_task_on_a_text_model_is_refused_by_name(tmp_path: Path) -> None:
    config = TrainConfig.with_defaults(demo=True, arch="qwen3-moe", demo_task="colours", home=tmp_path)
    assert demo_refusal(config) == (
        "--demo-task colours sends pictures, and qwen3_moe is a text model: use --demo-task parity"
    )
    clips = TrainConfig.with_defaults(demo=True, arch="qwen2.5-vl", demo_task="video-audio", home=tmp_path)
    assert demo_refusal(clips) == "--demo-task video-audio needs an Omni model (an audio tower), not qwen2_5_vl"
    parity = TrainConfig.with_defaults(demo=True, arch="qwen3-vl", demo_task="parity", home=tmp_path)
    assert demo_refusal(parity) is None  # any model can answer a text question


def test_the_encoder_stage_of_a_text_model_starts_and_refuses_items(text_model: Path) -> None:
    towers = Towers(text_model)
    assert towers.visual is None and towers.audio is None and towers.version
    assert towers.encode([]) == []
    import preprocess as pp

    image = pp.process_image(samples.encode_image(samples.test_pattern(64, 64), "PNG"), pp.ProcessorSpec.qwen3_vl())
    with pytest.raises(NoTower, match=r"this model \(qwen3\) has no vision tower"):
        towers.encode([image])
