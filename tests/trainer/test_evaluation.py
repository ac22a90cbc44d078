"""`trainer.evaluation`'s pieces that need no stack: which modalities and source a row counts under, and the
spec's checks (the evaluation itself runs against a real stack in tests/trainer/test_trackers_and_eval.py)."""

from __future__ import annotations

import pytest

from trainer.evaluation import EvalSpec, modalities_of, source_of


def _row(*parts: dict[str, object], **fields: object) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "which?"}]}], **fields}


def test_a_rows_modalities_come_from_its_content_parts() -> None:
    assert modalities_of({"messages": [{"role": "user", "content": "plain text"}]}) == ["text"]
    assert modalities_of(_row({"type": "image_url", "image_url": {"url": "a.png"}})) == ["image"]
    clip = {"type": "video_url", "video_url": {"url": "a.mp4", "use_audio_in_video": True}}
    assert modalities_of(_row(clip, {"type": "input_audio", "input_audio": {"data": ""}})) == ["video", "audio"]
    assert modalities_of(_row({"type": "image", "image": "a.png"}, {"type": "audio", "audio": "a.wav"})) == [
        "image",
        "audio",
    ]  # Qwen-style parts too


def test_a_rows_source_is_its_data_source() -> None:
    assert source_of(_row(data_source="geo3k")) == "geo3k" and source_of(_row()) == "default"


def test_an_evaluation_needs_rows_and_positive_sizes() -> None:
    with pytest.raises(ValueError, match="at least one row"):
        EvalSpec(rows=[], every=1)
    with pytest.raises(ValueError, match="1 or more"):
        EvalSpec(rows=[_row()], every=0)
    assert EvalSpec(rows=[_row()], every=3).due(6) and not EvalSpec(rows=[_row()], every=3).due(4)
