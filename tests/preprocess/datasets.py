"""Datasets as other frameworks write them, made here with real media: verl's geo3k Parquet (Hugging Face
``Image`` structs in an ``images`` column, ``<image>`` markers in a chat ``prompt``) and the folder
``datasets.Dataset.save_to_disk`` writes (its Arrow stream files and ``state.json``), written by `datasets`."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from preprocess import samples

__all__ = ["GEO3K_SCHEMA", "geo3k_row", "png", "write_geo3k", "write_saved_dataset"]

# verl's examples/data_preprocess/geo3k.py: `images` holds `datasets.Image` structs.
_IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
GEO3K_SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("images", pa.list_(_IMAGE)),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
        ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64())])),
    ]
)
_INSTRUCTION = (
    "You FIRST think about the reasoning process as an internal monologue and then provide the final answer. "
    "The final answer MUST BE put in \\boxed{}."
)


def png(seed: int, size: int = 56) -> bytes:
    return samples.encode_image(samples.test_pattern(size, size, seed=seed), "PNG")


def geo3k_row(index: int, images: list[bytes], answer: str, *, markers: int | None = None) -> dict[str, object]:
    """A geo3k row: ``markers`` ``<image>`` markers (as many as images unless given) and the images as structs."""
    problem = "<image>" * (len(images) if markers is None else markers) + f"Find x in figure {index}."
    return {
        "data_source": "hiyouga/geometry3k",
        "prompt": [{"role": "user", "content": f"{problem} {_INSTRUCTION}"}],
        "images": [{"bytes": image, "path": None} for image in images],
        "ability": "math",
        "reward_model": {"ground_truth": answer, "style": "rule"},
        "extra_info": {"split": "train", "index": index},
    }


def write_geo3k(path: Path, rows: list[dict[str, object]]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows, schema=GEO3K_SCHEMA), path)
    return path


def write_saved_dataset(folder: Path, rows: list[dict[str, object]], *, shards: int = 2) -> Path:
    """``rows`` as ``Dataset.save_to_disk`` lays them out (with `datasets` itself): ``data-0000k-of-0000n.arrow``
    IPC streams, ``dataset_info.json`` and ``state.json`` naming the files in order."""
    import datasets

    table = pa.Table.from_pylist(rows, schema=GEO3K_SCHEMA)
    datasets.Dataset(datasets.table.InMemoryTable(table)).save_to_disk(str(folder), num_shards=shards)
    return folder
