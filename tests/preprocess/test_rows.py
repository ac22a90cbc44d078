"""verl / slime rows as Weir's rollout prompts (`preprocess.rows`): markers become media parts in place, the
rule ground truth becomes the built-in ``math`` reward, and a row that cannot be a prompt is skipped by code."""

from __future__ import annotations

import base64
import json
import logging
from pathlib import Path

import pytest

from preprocess.errors import DatasetError
from preprocess.rows import dataset_refusal, iter_prompt_rows, prompt_row
from rollout.rewards import RewardRegistry, RewardSpec

from .datasets import geo3k_row, png, write_geo3k


def _bytes(url: object) -> bytes:
    assert isinstance(url, str) and url.startswith("data:application/octet-stream;base64,")
    return base64.b64decode(url.partition(",")[2])


def test_a_geo3k_row_becomes_messages_with_its_images_in_place_and_a_math_reward(tmp_path: Path) -> None:
    row = geo3k_row(0, [png(1)], "\\frac{2}{3}")
    row["prompt"] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "A<image>B<image>"}]
    row["images"] = [{"bytes": png(1), "path": None}, {"bytes": png(2), "path": "b.png"}]

    prompt = prompt_row(row, tmp_path)

    assert set(prompt) == {"messages", "reward", "data_source"}  # extra_info, ability: dropped
    system, user = prompt["messages"]  # type: ignore[misc]
    assert system == {"role": "system", "content": "Be brief."}
    parts = user["content"]
    assert [p["type"] for p in parts] == ["text", "image_url", "text", "image_url"]
    assert [_bytes(p["image_url"]["url"]) for p in parts[1::2]] == [png(1), png(2)]
    assert parts[0]["text"] == "A" and parts[2]["text"] == "B"
    assert prompt["reward"] == {"type": "math", "answer": "\\frac{2}{3}"}
    assert prompt["data_source"] == "hiyouga/geometry3k"
    # The mapping grades as verl's rule rewards do: the boxed answer against the ground truth.
    registry = RewardRegistry()
    spec = RewardSpec(type="math", answer="\\frac{2}{3}")
    context = {"group_id": "g", "prompt_index": 0, "sample_index": 0, "finish_reason": "stop", "response_ids": []}
    assert registry.compute(spec, "so x = \\boxed{\\frac{4}{6}}", context) == 1.0  # type: ignore[arg-type]
    assert registry.compute(spec, "so x = \\boxed{3}", context) == 0.0  # type: ignore[arg-type]


def test_a_slime_row_with_a_string_prompt_and_paths(tmp_path: Path) -> None:
    (tmp_path / "media").mkdir()
    (tmp_path / "media" / "a.wav").write_bytes(b"RIFF")
    row = {"prompt": "<audio>What is said?", "audios": ["media/a.wav"], "reward_model": {"ground_truth": 12}}

    prompt = prompt_row(row, tmp_path)

    audio = {"type": "audio_url", "audio_url": {"url": str(tmp_path / "media" / "a.wav")}}
    assert prompt["messages"] == [{"role": "user", "content": [audio, {"type": "text", "text": "What is said?"}]}]
    assert prompt["reward"] == {"type": "math", "answer": "12"}
    with pytest.raises(DatasetError) as caught:
        prompt_row({**row, "audios": ["media/gone.wav"]}, tmp_path)
    assert caught.value.code == "media_not_found"


def test_weir_rows_pass_as_they_are_and_rows_without_a_reward_get_none(tmp_path: Path) -> None:
    weir = {"messages": [{"role": "user", "content": "hi"}], "reward": {"type": "exact_match", "answer": "yes"}}
    assert prompt_row(weir, tmp_path) == weir
    plain = prompt_row({"prompt": [{"role": "user", "content": "Say yes."}]}, tmp_path)
    assert plain == {"messages": [{"role": "user", "content": "Say yes."}], "reward": {"type": "none"}}
    parts = [{"type": "text", "text": "<image>Colour?"}, {"type": "image", "image": "b.png"}]
    marked = prompt_row({"prompt": [{"role": "user", "content": parts}], "images": [png(1)]}, tmp_path)
    content = marked["messages"][0]["content"]  # type: ignore[index]
    assert [p["type"] for p in content] == ["image_url", "text", "image"]  # markers in text parts too


@pytest.mark.parametrize(
    ("row", "code"),
    [
        ({"prompt": "<image><image>", "images": [b"x"]}, "marker_mismatch"),
        ({"prompt": "x", "reward_model": {"ground_truth": "1", "style": "model"}}, "unsupported_reward"),
        ({"prompt": "x", "reward_model": {"ground_truth": {"target": ["a"]}, "style": "rule"}}, "unsupported_reward"),
        ({"question": "x"}, "invalid_row"),
        ({"prompt": {"role": "user"}}, "invalid_row"),
        ({"prompt": [{"content": "no role"}]}, "invalid_row"),
        ({"prompt": "<image>", "images": [3.5]}, "unsupported_media_value"),
    ],
)
def test_a_row_that_cannot_be_a_prompt_is_named_by_code(row: dict[str, object], code: str, tmp_path: Path) -> None:
    with pytest.raises(DatasetError) as caught:
        prompt_row(row, tmp_path)
    assert caught.value.code == code


def test_iter_prompt_rows_skips_bad_rows_by_code_and_refuses_a_dataset_of_none(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good, bad = geo3k_row(0, [png(0)], "3"), geo3k_row(1, [png(1)], "4", markers=0)
    dataset = write_geo3k(tmp_path / "train.parquet", [bad, good, bad])
    with caplog.at_level(logging.WARNING, logger="preprocess.rows"):
        prompts = list(iter_prompt_rows(dataset))
    assert [p["reward"] for p in prompts] == [{"type": "math", "answer": "3"}]
    assert "row 0 skipped (marker_mismatch)" in caplog.text and "{'marker_mismatch': 2}" in caplog.text

    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_text(json.dumps({"prompt": "<video>"}) + "\n")
    with pytest.raises(DatasetError, match="1 <video> markers but the row has 0 videos"):
        list(iter_prompt_rows(jsonl))


def test_a_dataset_with_no_reward_in_any_row_is_refused_before_training(tmp_path: Path) -> None:
    """Every group of such a dataset would be stored as having nothing to train on, and the trainer would wait
    for a micro-batch that never comes: `weir train` refuses it up front. One rewarded row is enough."""
    rows = tmp_path / "rows.csv"
    rows.write_text("prompt,answer\nhow many sides has a triangle?,3\nand a square?,4\n")
    assert dataset_refusal(rows) == (
        f"--dataset {rows}: no row has a reward (a 'reward' spec, or verl's reward_model.ground_truth), so no "
        "sample could be trained on [no_reward]"
    )
    assert dataset_refusal(rows, scored_elsewhere=True) is None  # a rollout function of the user's scores them
    weir_rows = tmp_path / "weir.jsonl"  # Weir's own rows with no reward spec: the rollout's default, none
    weir_rows.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    assert dataset_refusal(weir_rows) is not None
    environment = tmp_path / "environment.jsonl"  # an environment's steps are rewarded: nothing to refuse
    environment.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}], "environment": {"url": "http://e"}}) + "\n"
    )
    assert dataset_refusal(environment) is None
    mixed = tmp_path / "mixed.jsonl"
    verl = {"prompt": [{"role": "user", "content": "1+2?"}], "reward_model": {"ground_truth": "3", "style": "rule"}}
    mixed.write_text(json.dumps({"prompt": "hi"}) + "\n" + json.dumps(verl) + "\n")
    assert dataset_refusal(mixed) is None


def test_a_csv_carries_its_nested_columns_as_json(tmp_path: Path) -> None:
    """A CSV cell cannot nest: verl's reward_model and a prompt of messages are JSON text there, decoded; a
    prompt that only starts with a bracket stays text; a nested column that is no JSON is a bad row by code."""
    import csv

    rows = tmp_path / "rows.csv"
    with rows.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["prompt", "reward_model"])
        writer.writerow([json.dumps([{"role": "user", "content": "1+2?"}]), json.dumps({"ground_truth": "3"})])
        writer.writerow(["[1, 2] summed?", json.dumps({"ground_truth": "3", "style": "rule"})])
    prompts = list(iter_prompt_rows(rows))
    assert [p["reward"] for p in prompts] == [{"type": "math", "answer": "3"}] * 2
    assert [p["messages"] for p in prompts] == [
        [{"role": "user", "content": "1+2?"}],
        [{"role": "user", "content": "[1, 2] summed?"}],
    ]
    assert dataset_refusal(rows) is None
    broken = tmp_path / "broken.csv"
    broken.write_text('prompt,reward_model\nhi,"{not json"\n')
    assert "[invalid_json]" in (dataset_refusal(broken) or "") and "line 2" in (dataset_refusal(broken) or "")
