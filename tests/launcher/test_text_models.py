"""Text models (Qwen3, Qwen3-MoE) through the stack: their demo is the colour-word task; the media roles start for them
and refuse any item by name (nothing cached); a picture task on a text model is refused before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from encoders.embedded_model import init_model
from encoders.errors import NoTower
from encoders.towers import Towers
from launcher.config import TrainConfig
from launcher.demo.task import COLOURS, write_colour_word_task
from launcher.model import demo_refusal
from preprocess import samples


@pytest.fixture(scope="module")
def text_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("qwen3") / "model", arch="qwen3")


def test_the_colour_word_task_is_balanced_deterministic_and_holds_out_unseen_lines() -> None:
    rows, held_out = write_colour_word_task()
    assert (len(rows), len(held_out)) == (64, 16)
    assert write_colour_word_task() == (rows, held_out)
    assert [row["reward"]["answer"] for row in rows[:4]] == list(COLOURS)  # balanced from the first rows

    def line(row: dict) -> str:
        return str(row["messages"][0]["content"])

    assert len({line(r) for r in rows + held_out}) == 80  # no line twice, none held out that was trained on
    for row in rows + held_out:
        named = [c for c in COLOURS if c in line(row).split(": ")[1]]
        assert named == [row["reward"]["answer"]]


def test_the_text_archs_are_the_registrys_text_families() -> None:
    from encoders.architectures import FAMILIES
    from encoders.embedded_model import ARCHITECTURES
    from launcher.config import TEXT_ARCHS

    text = {name for name, family in FAMILIES.items() if not family.media}
    assert {arch.replace("-", "_") for arch in TEXT_ARCHS} == text and set(TEXT_ARCHS) <= set(ARCHITECTURES)


def test_a_text_arch_s_demo_is_the_colour_word_task() -> None:
    assert TrainConfig.with_defaults(demo=True, arch="qwen3", demo_task=None).demo_task == "colour-words"
    assert TrainConfig.with_defaults(demo=True, arch="qwen3-vl", demo_task=None).demo_task == "colours"
    assert TrainConfig.with_defaults(demo=False, arch="qwen3", demo_task=None).demo_task == "colours"


def test_a_picture_task_on_a_text_model_is_refused_by_name(tmp_path: Path) -> None:
    config = TrainConfig.with_defaults(demo=True, arch="qwen3-moe", demo_task="colours", home=tmp_path)
    assert demo_refusal(config) == (
        "--demo-task colours sends pictures, and qwen3_moe is a text model: use --demo-task colour-words"
    )
    clips = TrainConfig.with_defaults(demo=True, arch="qwen2.5-vl", demo_task="video-audio", home=tmp_path)
    assert demo_refusal(clips) == "--demo-task video-audio needs an Omni model (an audio tower), not qwen2_5_vl"
    words = TrainConfig.with_defaults(demo=True, arch="qwen3-vl", demo_task="colour-words", home=tmp_path)
    assert demo_refusal(words) is None  # any model can answer a text question


def test_the_encoder_stage_of_a_text_model_starts_and_refuses_items(text_model: Path) -> None:
    towers = Towers(text_model)
    assert towers.visual is None and towers.audio is None and towers.version
    assert towers.encode([]) == []
    import preprocess as pp

    image = pp.process_image(samples.encode_image(samples.test_pattern(64, 64), "PNG"), pp.ProcessorSpec.qwen3_vl())
    with pytest.raises(NoTower, match=r"this model \(qwen3\) has no vision tower"):
        towers.encode([image])
