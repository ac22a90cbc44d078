"""Datasets as they come (`preprocess.dataset`): verl / geo3k Parquet with Hugging Face ``Image`` structs,
``save_to_disk`` folders, folders of Parquet shards, decoded ``Audio`` arrays — and ``weir prep``'s job on
them, where every bad row or item is a counted failure with its code and text-only rows are counted."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import preprocess as pp
from preprocess.dataset import dataset_base, iter_rows, media_ref, row_media
from preprocess.errors import DatasetError
from preprocess.prep import run_prep

from .datasets import geo3k_row, png, write_geo3k, write_saved_dataset


def test_prep_of_a_geo3k_parquet_counts_every_image_and_every_failure(tmp_path: Path) -> None:
    (tmp_path / "figs").mkdir()
    (tmp_path / "figs" / "a.png").write_bytes(png(7))
    rows = [
        geo3k_row(0, [png(0)], "3"),
        geo3k_row(1, [png(1), png(2)], "\\frac{2}{3}"),
        geo3k_row(2, [b"not an image"], "4"),  # bytes that are no image
        geo3k_row(3, [png(3)], "5", markers=2),  # two markers, one image
        geo3k_row(4, [], "6"),  # text only
        {**geo3k_row(5, [], "7", markers=1), "images": [{"bytes": None, "path": "figs/missing.png"}]},
        {**geo3k_row(6, [], "8", markers=1), "images": [{"bytes": None, "path": "figs/a.png"}]},  # by path
    ]
    dataset = write_geo3k(tmp_path / "train.parquet", rows)

    report = run_prep(dataset, tmp_path / "out", pp.ProcessorSpec.qwen2_5_omni(), workers=1, progress=False)

    assert (report.rows, report.rows_without_media, report.items, report.failed) == (7, 1, 7, 3)
    assert report.failures == {"unsupported_media": 1, "marker_mismatch": 1, "media_not_found": 1}
    assert report.tokens_after == {"image": 4 * 4}  # rows 0, 1 (two) and 6; 56 × 56: four tokens each
    assert report.to_dict()["rows_without_media"] == 1
    manifest = pq.read_table(tmp_path / "out" / "manifest.parquet").to_pylist()
    by_row = {(m["row"], m["item"]): (m["key"] is not None, m["error_code"], m["source"]) for m in manifest}
    assert by_row[(1, 1)][:2] == (True, None) and by_row[(6, 0)] == (True, None, "figs/a.png")
    assert by_row[(3, 0)][1] == "marker_mismatch" and by_row[(5, 0)][1] == "media_not_found"


def test_a_save_to_disk_folder_and_a_folder_of_parquet_shards_read_in_order(tmp_path: Path) -> None:
    rows = [geo3k_row(i, [png(i)], str(i)) for i in range(5)]
    saved = write_saved_dataset(tmp_path / "saved", rows, shards=2)
    shards = tmp_path / "shards"
    shards.mkdir()
    write_geo3k(shards / "train-00001-of-00002.parquet", rows[3:])
    write_geo3k(shards / "train-00000-of-00002.parquet", rows[:3])

    for folder in (saved, shards):
        read = list(iter_rows(folder))
        assert [r["reward_model"]["ground_truth"] for r in read] == ["0", "1", "2", "3", "4"]
        assert dataset_base(folder) == folder.resolve()
        assert [ref.read() for r in read for ref in row_media(r, folder)] == [png(i) for i in range(5)]


def test_a_dataset_dict_folder_without_its_splits_and_an_empty_folder_are_refused(tmp_path: Path) -> None:
    # a DatasetDict's split is read (tests/preprocess/test_hf_datasets.py); one whose split folders are gone is not
    (tmp_path / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with pytest.raises(DatasetError, match="a save_to_disk folder datasets cannot load") as caught:
        list(iter_rows(tmp_path))
    assert caught.value.code == "invalid_dataset"
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DatasetError, match="no dataset datasets can resolve") as caught:
        list(iter_rows(empty))
    assert caught.value.code == "invalid_dataset"


def test_column_values_of_every_shape(tmp_path: Path) -> None:
    image = png(1)
    (tmp_path / "a.png").write_bytes(image)
    uri = "data:image/png;base64," + base64.b64encode(image).decode()
    values = ["a.png", f"file://{tmp_path / 'a.png'}", uri, image, {"bytes": image, "path": "x.png"}, {"path": "a.png"}]
    refs = [media_ref("image", v, tmp_path) for v in values]
    assert [r.read() for r in refs] == [image] * len(values)
    assert refs[4].source == "x.png"  # the struct's path names the item; its bytes are read
    for bad in (3, {"bytes": None, "path": None}, {"width": 4}):
        with pytest.raises(DatasetError) as caught:
            media_ref("image", bad, tmp_path)
        assert caught.value.code == "unsupported_media_value"
    with pytest.raises(DatasetError) as caught:
        row_media({"images": [image, 7]}, tmp_path)
    assert caught.value.code == "unsupported_media_value"


def test_a_decoded_hf_audio_value_becomes_a_wav_that_probes_as_itself(tmp_path: Path) -> None:
    tone = (0.5 * np.sin(np.arange(16000) / 5)).astype(np.float32)
    for array in (tone, tone.tolist()):
        ref = media_ref("audio", {"array": array, "sampling_rate": 16000, "path": None}, tmp_path)
        header = pp.probe(ref.read(), "audio")
        assert (header.sample_rate, header.num_samples, header.channels) == (16000, 16000, 1)
    for bad in ({"array": np.zeros((2, 8)), "sampling_rate": 16000}, {"array": tone, "sampling_rate": "16k"}):
        with pytest.raises(DatasetError) as caught:
            media_ref("audio", bad, tmp_path)
        assert caught.value.code == "unsupported_media_value"


def test_verl_markers_bind_to_their_columns_and_a_mismatch_is_named(tmp_path: Path) -> None:
    row = {"prompt": "<video>then<image>and<image>", "images": [png(1), png(2)], "videos": [{"path": "v.mp4"}]}
    assert [(r.kind, r.source) for r in row_media(row, tmp_path)] == [
        ("image", "<inline>"),
        ("image", "<inline>"),
        ("video", "v.mp4"),
    ]
    with pytest.raises(DatasetError, match="1 <audio> markers but the row has 0 audios") as caught:
        row_media({"prompt": [{"role": "user", "content": "hear <audio>"}]}, tmp_path)
    assert caught.value.code == "marker_mismatch"
    # Weir's own rows bind nothing: columns and parts are read as they are, Qwen-style parts too.
    weir = {"images": ["a.png"], "messages": [{"role": "user", "content": [{"type": "audio", "audio": "b.wav"}]}]}
    assert [(r.kind, r.source) for r in row_media(weir, tmp_path)] == [("image", "a.png"), ("audio", "b.wav")]


def test_an_arrow_file_in_the_file_format_reads_too(tmp_path: Path) -> None:
    path = tmp_path / "rows.arrow"
    table = pa.table({"image": [png(1)], "question": ["?"]})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    assert [r["question"] for r in iter_rows(path)] == ["?"]
