"""Datasets as Hugging Face ships them, made here with the real `datasets` library (`preprocess.reading`):
``save_to_disk`` folders of a Dataset and of a DatasetDict, Hub-layout folders (split file names, README
``configs:``), a hub id read offline from the Hugging Face cache — each read one split at a time, a split that
is not there refused naming those that are — and rows that cannot be read (a line that is no JSON, a CSV line
with too many fields) counted with their line and code: in ``weir prep``'s report, and as ``weir train``'s
one-line refusal before anything starts."""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import datasets
import huggingface_hub.constants
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import preprocess as pp
from preprocess.dataset import dataset_base, iter_rows, row_media
from preprocess.errors import DatasetError
from preprocess.prep import run_prep
from preprocess.reading import BadRow, open_dataset
from preprocess.rows import dataset_refusal, iter_prompt_rows

from .datasets import png

SIZES = {"train": 3, "test": 2, "validation": 1}
REPO = Path(__file__).resolve().parents[2]


def _rows(split: str, n: int) -> list[dict[str, object]]:
    return [{"prompt": f"{split} {i}", "reward_model": {"ground_truth": str(i), "style": "rule"}} for i in range(n)]


def _counts(dataset: Path | str) -> dict[str, int]:
    return {split: len(list(iter_rows(dataset, split))) for split in SIZES}


def _hub_layout(folder: Path) -> Path:
    """Splits as `push_to_hub` names their Parquet shards: ``data/{split}-0000k-of-0000n.parquet``."""
    (folder / "data").mkdir(parents=True)
    for split, n in SIZES.items():
        pq.write_table(pa.Table.from_pylist(_rows(split, n)), folder / "data" / f"{split}-00000-of-00001.parquet")
    return folder


def test_a_save_to_disk_dataset_with_image_features_reads_its_raw_structs(tmp_path: Path) -> None:
    features = datasets.Features({"prompt": datasets.Value("string"), "images": [datasets.Image()]})
    rows = [{"prompt": f"<image>figure {i}", "images": [{"bytes": png(i), "path": None}]} for i in range(3)]
    datasets.Dataset.from_list(rows, features=features).save_to_disk(str(tmp_path / "saved"), num_shards=2)

    read = list(iter_rows(tmp_path / "saved"))
    assert [r["prompt"] for r in read] == ["<image>figure 0", "<image>figure 1", "<image>figure 2"]
    assert [ref.read() for r in read for ref in row_media(r, tmp_path)] == [png(i) for i in range(3)]  # not PIL
    assert len(list(iter_rows(tmp_path / "saved", "train"))) == 3  # its one split, named
    with pytest.raises(DatasetError, match="no split 'test': its splits are train") as caught:
        open_dataset(tmp_path / "saved", "test")
    assert caught.value.code == "unknown_split"


def test_a_save_to_disk_dataset_dict_reads_the_split_asked_for(tmp_path: Path) -> None:
    splits = {s: datasets.Dataset.from_list(_rows(s, n)) for s, n in SIZES.items()}
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "dd"))

    assert _counts(tmp_path / "dd") == SIZES
    assert [r["prompt"] for r in iter_rows(tmp_path / "dd")] == ["train 0", "train 1", "train 2"]  # train unasked
    assert dataset_base(tmp_path / "dd", "test") == (tmp_path / "dd").resolve()
    with pytest.raises(DatasetError, match="no split 'dev': its splits are train, test, validation") as caught:
        list(iter_rows(tmp_path / "dd", "dev"))
    assert caught.value.code == "unknown_split"
    assert [p["reward"] for p in iter_prompt_rows(tmp_path / "dd", "validation")] == [{"type": "math", "answer": "0"}]


def test_a_hub_layout_folder_splits_by_file_name_at_its_root_and_in_data(tmp_path: Path) -> None:
    hub = _hub_layout(tmp_path / "hub")
    assert _counts(hub) == SIZES  # was a DatasetError at the root
    assert _counts(hub / "data") == SIZES  # was one dataset of 6 rows, the splits mixed
    flat = tmp_path / "flat"  # split names as file names, JSON Lines
    flat.mkdir()
    for split, n in SIZES.items():
        (flat / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(split, n)))
    assert _counts(flat) == SIZES
    with pytest.raises(DatasetError, match="its splits are train, (test|validation), (test|validation)"):
        open_dataset(hub, "dev")


def test_a_readme_configs_section_names_the_splits_files(tmp_path: Path) -> None:
    folder = tmp_path / "configured"
    (folder / "raw").mkdir(parents=True)
    for name, rows in (("a", _rows("fit", 4)), ("b", _rows("held", 2))):
        (folder / "raw" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "README.md").write_text(
        "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: raw/a.jsonl\n"
        "  - split: test\n    path: raw/b.jsonl\n---\n# a dataset\n"
    )
    assert [len(list(iter_rows(folder, s))) for s in ("train", "test")] == [4, 2]
    assert next(iter_rows(folder, "test"))["prompt"] == "held 0"


def test_a_folder_of_rows_next_to_more_images_reads_the_rows(tmp_path: Path) -> None:
    # datasets would make an imagefolder of it (more .png than .jsonl files): the rows files are the dataset
    (tmp_path / "images").mkdir()
    for i in range(3):
        (tmp_path / "images" / f"{i}.png").write_bytes(png(i))
    (tmp_path / "rows.jsonl").write_text(json.dumps({"prompt": "<image>?", "images": ["images/1.png"]}) + "\n")
    (row,) = iter_rows(tmp_path)
    assert [ref.read() for ref in row_media(row, dataset_base(tmp_path))] == [png(1)]


def _cached_hub_dataset(hub_cache: Path, repo_id: str) -> Path:
    """``repo_id`` as huggingface_hub leaves a dataset it downloaded: ``datasets--owner--name/refs/main`` naming
    the commit, its files under ``snapshots/<commit>/`` (links into ``blobs/`` there; plain files read alike)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    storage = hub_cache / ("datasets--" + repo_id.replace("/", "--"))
    (storage / "refs").mkdir(parents=True)
    (storage / "refs" / "main").write_text(commit)
    _hub_layout(storage / "snapshots" / commit)
    (storage / "snapshots" / commit / "README.md").write_text("---\nlicense: mit\n---\n")
    return storage / "snapshots" / commit


def test_a_hub_id_resolves_offline_from_the_hugging_face_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    dialled: list[object] = []  # nothing reaches for the network, whatever HF_HUB_OFFLINE says here

    def connect(self: socket.socket, address: object) -> None:
        dialled.append(address)
        raise OSError("no network in this test")

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket, "getaddrinfo", lambda *address, **_: connect(socket.socket(), address))
    snapshot = _cached_hub_dataset(tmp_path / "hub", "weir-tests/splits")

    assert _counts("weir-tests/splits") == SIZES
    assert dataset_base("weir-tests/splits") == snapshot.resolve()
    with pytest.raises(DatasetError, match="no split 'dev'"):
        open_dataset("weir-tests/splits", "dev")
    with pytest.raises(DatasetError, match="nor a dataset in the Hugging Face cache.*hf download") as caught:
        open_dataset("weir-tests/absent")  # offline: refused, never fetched
    assert caught.value.code == "dataset_not_found"
    assert not (tmp_path / "hub" / "datasets--weir-tests--absent").exists() and not dialled


def test_a_hub_id_that_load_dataset_prepared_resolves_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # load_dataset(owner/name) online leaves the prepared Arrow in HF_DATASETS_CACHE/owner___name/config/version/hash;
    # made here from a local folder of that name's layout, then put where a hub id's would be.
    cache = tmp_path / "datasets"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    datasets.load_dataset(str(_hub_layout(tmp_path / "splits")), cache_dir=str(cache))
    (cache / "splits").rename(cache / "weir-tests___splits")

    assert _counts("weir-tests/splits") == SIZES


def test_csv_rows_and_a_line_with_too_many_fields(tmp_path: Path) -> None:
    path = tmp_path / "rows.csv"
    path.write_text('prompt,image\n"<image>two\nlines",a.png\nplain,\n\nbad,b.png,extra\n')
    records = list(open_dataset(path).records())
    assert records[:2] == [{"prompt": "<image>two\nlines", "image": "a.png"}, {"prompt": "plain", "image": None}]
    bad = BadRow(file="rows.csv", index=2, line=6, code="invalid_csv_row", message="3 fields, the header has 2")
    assert records[2] == bad  # line 6: the two-line value counts as its lines, the blank line as one
    assert [r.source for r in row_media(next(iter_rows(path)), tmp_path)] == ["a.png"]


def test_a_json_file_is_an_array_or_json_lines_and_a_corrupt_parquet_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "array.json").write_text('\n[{"prompt": "a"}, 3]')
    (tmp_path / "lines.json").write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    assert list(open_dataset(tmp_path / "array.json").records())[1] == BadRow(
        file="array.json", index=1, line=None, code="invalid_row", message="a JSON int, not an object (a row is one)"
    )
    assert [r["prompt"] for r in iter_rows(tmp_path / "lines.json")] == ["a", "b"]
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DatasetError, match="broken.parquet: not a parquet file Weir can read") as caught:
        list(iter_rows(tmp_path / "broken.parquet"))
    assert caught.value.code == "invalid_dataset"


def test_an_unknown_file_type_is_refused_by_name(tmp_path: Path) -> None:
    for name in ("rows.txt", "rows.tsv.gz"):
        (tmp_path / name).write_text("prompt\n")
        with pytest.raises(DatasetError, match=rf"{name}: a \.(txt|gz) file is no dataset Weir reads") as caught:
            list(iter_rows(tmp_path / name))
        assert caught.value.code == "unknown_file_type"
    with pytest.raises(DatasetError, match="text files; Weir reads") as caught:
        open_dataset(tmp_path)  # a folder datasets reads as text files
    assert caught.value.code == "unknown_file_type"


def _bad_jsonl(folder: Path) -> Path:
    path = folder / "bad.jsonl"
    path.write_text('{"prompt": "a"}\n\nnot json\n{"prompt": "b"}\n[1, 2]\n')
    return path


def test_prep_counts_a_bad_line_with_its_line_number_and_code(tmp_path: Path) -> None:
    records = list(open_dataset(_bad_jsonl(tmp_path)).records())
    assert [r.where if isinstance(r, BadRow) else r["prompt"] for r in records] == [
        "a",
        "bad.jsonl line 3",
        "b",
        "bad.jsonl line 5",
    ]
    report = run_prep(tmp_path / "bad.jsonl", tmp_path / "out", pp.ProcessorSpec.qwen3_vl(), workers=1, progress=False)

    assert (report.rows, report.rows_unreadable, report.rows_without_media, report.failed) == (4, 2, 2, 2)
    assert report.failures == {"invalid_json": 1, "invalid_row": 1}
    listed = report.to_dict()["bad_rows"]
    assert [(r["row"], r["line"], r["code"]) for r in listed] == [(1, 3, "invalid_json"), (3, 5, "invalid_row")]
    manifest = pq.read_table(tmp_path / "out" / "manifest.parquet").to_pylist()
    assert [(m["row"], m["source"], m["error_code"]) for m in manifest] == [
        (1, "bad.jsonl line 3", "invalid_json"),
        (3, "bad.jsonl line 5", "invalid_row"),
    ]
    assert dataset_refusal(tmp_path / "bad.jsonl") == (
        f"--dataset {tmp_path / 'bad.jsonl'}: 2 rows cannot be read, the first at bad.jsonl line 3: not JSON "
        "(Expecting value at column 1) [invalid_json]"
    )


def _weir(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "launcher.cli", *args],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.integration
def test_weir_train_refuses_bad_rows_and_a_missing_split_in_one_line_before_anything_starts(tmp_path: Path) -> None:
    home = tmp_path / "home"
    done = _weir("train", "--dataset", str(_bad_jsonl(tmp_path)), "--home", str(home))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"weir train: --dataset {tmp_path / 'bad.jsonl'}: 2 rows cannot be read, the first at bad.jsonl line 3: "
        "not JSON (Expecting value at column 1) [invalid_json]"
    ]
    assert not home.exists()  # nothing started, nothing written
    _hub_layout(tmp_path / "hub")
    done = _weir("train", "--dataset", str(tmp_path / "hub"), "--split", "dev", "--home", str(home))
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "no split 'dev': its splits are train" in done.stderr and "[unknown_split]" in done.stderr
    assert not home.exists()


@pytest.mark.integration
def test_weir_prep_reads_a_cached_hub_id_offline_by_split(tmp_path: Path) -> None:
    _cached_hub_dataset(tmp_path / "hf" / "hub", "weir-tests/splits")
    hf = tmp_path / "hf"
    env = {"HF_HOME": str(hf), "HF_HUB_CACHE": str(hf / "hub"), "HF_DATASETS_CACHE": str(hf / "datasets")}
    env |= {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    out = tmp_path / "out"
    args = ("prep", "weir-tests/splits", "--split", "test", "--out", str(out), "--spec", "qwen3_vl", "--workers", "1")
    done = _weir(*args, env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads((out / "report.json").read_text())["rows"] == SIZES["test"]
    done = _weir("prep", "weir-tests/absent", "--out", str(out), env=env)
    assert done.returncode == 2 and "[dataset_not_found]" in done.stderr, done.stderr


def test_a_csv_field_over_128_kib_reads_and_a_line_the_reader_refuses_is_a_bad_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import csv

    import preprocess.reading as reading

    uri = "data:image/png;base64," + base64.b64encode(png(1) + b"\0" * 300_000).decode()  # an inline image, ~400 KB
    path = tmp_path / "big.csv"
    with path.open("w", newline="") as fh:
        csv.writer(fh).writerows([["prompt", "image"], ["<image>big", uri], ["small", ""]])
    limit = csv.field_size_limit()
    assert [r["image"] for r in iter_rows(path)] == [uri, None]
    assert csv.field_size_limit() == limit  # the process-wide limit is put back
    monkeypatch.setattr(reading, "_CSV_FIELD_LIMIT", 1000)  # any other csv.Error: that line, and the rows after it
    (big, small) = open_dataset(path).records()
    assert isinstance(big, BadRow) and (big.line, big.code) == (2, "invalid_csv")
    assert "field larger than field limit (1000)" in big.message and small == {"prompt": "small", "image": None}
    monkeypatch.setattr(reading, "_CSV_FIELD_LIMIT", 4)
    with pytest.raises(DatasetError, match="line 1: a header the CSV reader refuses") as caught:
        list(iter_rows(path))
    assert caught.value.code == "invalid_csv"


def test_a_byte_order_mark_is_no_part_of_the_first_column_or_row(tmp_path: Path) -> None:
    bom = b"\xef\xbb\xbf"
    (tmp_path / "rows.csv").write_bytes(bom + b"prompt,image\nhello,\n")
    (tmp_path / "rows.jsonl").write_bytes(bom + b'{"prompt": "hello"}\n')
    (tmp_path / "rows.json").write_bytes(bom + b'  [{"prompt": "hello"}]')
    for name in ("rows.csv", "rows.jsonl", "rows.json"):
        assert next(iter_rows(tmp_path / name))["prompt"] == "hello", name


def test_a_byte_that_is_no_utf8_makes_its_line_a_bad_row_not_the_file(tmp_path: Path) -> None:
    (tmp_path / "rows.jsonl").write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n{"prompt": "b"}\n')
    (tmp_path / "rows.csv").write_bytes(b'prompt\na\n"caf\xe9\nau lait"\nb\n')
    for name, line in (("rows.jsonl", 2), ("rows.csv", 3)):
        records = list(open_dataset(tmp_path / name).records())
        assert [r["prompt"] for r in records if not isinstance(r, BadRow)] == ["a", "b"], name
        (bad,) = (r for r in records if isinstance(r, BadRow))
        assert (bad.where, bad.code) == (f"{name} line {line}", "invalid_utf8")
    report = run_prep(tmp_path / "rows.jsonl", tmp_path / "out", pp.ProcessorSpec.qwen3_vl(), workers=1, progress=False)
    assert (report.rows, report.rows_unreadable, report.failures) == (3, 1, {"invalid_utf8": 1})
    assert [(r["line"], r["code"]) for r in report.to_dict()["bad_rows"]] == [(2, "invalid_utf8")]


def test_compressed_text_files_are_read_and_other_compressed_files_refused_by_suffix(tmp_path: Path) -> None:
    import bz2
    import gzip
    import lzma

    lines = "".join(json.dumps(r) + "\n" for r in _rows("train", 3))
    (tmp_path / "rows.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    (tmp_path / "rows.json.xz").write_bytes(lzma.compress(json.dumps(_rows("train", 3)).encode()))
    (tmp_path / "rows.csv.bz2").write_bytes(bz2.compress(b"prompt\ntrain 0\ntrain 1\ntrain 2\n"))
    for name in ("rows.jsonl.gz", "rows.json.xz", "rows.csv.bz2"):
        assert [r["prompt"] for r in iter_rows(tmp_path / name)] == ["train 0", "train 1", "train 2"], name
    (tmp_path / "torn.jsonl.gz").write_bytes(gzip.compress(lines.encode())[:-12])
    with pytest.raises(DatasetError, match=r"torn.jsonl.gz: not a jsonl.gz file Weir can read \(EOFError") as caught:
        list(iter_rows(tmp_path / "torn.jsonl.gz"))
    assert caught.value.code == "invalid_dataset"
    (tmp_path / "rows.parquet.gz").write_bytes(gzip.compress(b"PAR1"))
    with pytest.raises(DatasetError, match=r"a \.parquet\.gz file is no dataset Weir reads.*compressed") as caught:
        open_dataset(tmp_path / "rows.parquet.gz")
    assert caught.value.code == "unknown_file_type"
    folder = tmp_path / "splits"  # a hub-layout folder of compressed files: split by name as datasets splits it
    folder.mkdir()
    for split, n in SIZES.items():
        (folder / f"{split}.jsonl.gz").write_bytes(
            gzip.compress("".join(json.dumps(r) + "\n" for r in _rows(split, n)).encode())
        )
    assert _counts(folder) == SIZES


def test_a_readme_whose_yaml_datasets_cannot_parse_is_named_in_one_line(tmp_path: Path) -> None:
    folder = tmp_path / "card"
    folder.mkdir()
    (folder / "train.jsonl").write_text('{"prompt": "a"}\n')
    (folder / "README.md").write_text("---\nconfigs: [a: b: c\n---\n# a dataset\n")
    with pytest.raises(DatasetError, match=r"card/README.md: a dataset card datasets cannot read \(") as caught:
        open_dataset(folder)
    assert caught.value.code == "invalid_dataset_card" and "\n" not in str(caught.value)
    (folder / "README.md").write_text("---\nconfigs: 3\n---\n")  # YAML, but no configs datasets can make of it
    with pytest.raises(DatasetError) as caught:
        open_dataset(folder)
    assert caught.value.code == "invalid_dataset_card" and "README.md" in str(caught.value)


def test_a_hub_id_prepared_in_several_configs_is_refused_naming_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "datasets"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    source = tmp_path / "splits"
    for config in ("plain", "hard"):
        (source / config).mkdir(parents=True)
        (source / config / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(config, 2)))
    (source / "README.md").write_text(
        "---\nconfigs:\n- config_name: plain\n  data_files: plain/*.jsonl\n"
        "- config_name: hard\n  data_files: hard/*.jsonl\n---\n"
    )
    for config in ("plain", "hard"):
        datasets.load_dataset(str(source), config, cache_dir=str(cache))
    (cache / "splits").rename(cache / "weir-tests___splits")
    with pytest.raises(
        DatasetError, match=r"weir-tests/splits: prepared .* in several configs \(hard, plain\)"
    ) as caught:
        open_dataset("weir-tests/splits")
    assert caught.value.code == "multiple_configs"


def test_weir_says_a_dataset_error_from_any_command_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import launcher.cli as cli
    import launcher.commands as commands

    def unreadable(*_: object) -> str:
        raise DatasetError("rows.jsonl line 3: not\nJSON", code="invalid_json")

    monkeypatch.setattr(cli, "refusal", unreadable)  # raised while the options are checked …
    (tmp_path / "rows.jsonl").write_text("{}\n")
    assert cli.main(["prep", str(tmp_path / "rows.jsonl"), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == "weir prep: rows.jsonl line 3: not JSON [invalid_json]\n"
    monkeypatch.setattr(cli, "refusal", lambda _: None)  # … or by the command itself
    monkeypatch.setitem(commands.HANDLERS, "demo", unreadable)
    assert cli.main(["demo"]) == 2
    assert capsys.readouterr().err == "weir demo: rows.jsonl line 3: not JSON [invalid_json]\n"


@pytest.mark.integration
def test_weir_prep_and_train_on_a_big_csv_a_bad_byte_and_a_bad_card(tmp_path: Path) -> None:
    uri = "data:image/png;base64," + base64.b64encode(png(2) + b"\0" * 200_000).decode()
    (tmp_path / "big.csv").write_text(f'prompt,image\n<image>big,"{uri}"\n')
    (tmp_path / "bad.jsonl").write_bytes(b'{"prompt": "a"}\n{"prompt": "\xff"}\n')
    (tmp_path / "card").mkdir()
    (tmp_path / "card" / "train.jsonl").write_text('{"prompt": "a"}\n')
    (tmp_path / "card" / "README.md").write_text("---\nconfigs: [a: b: c\n---\n")
    out = tmp_path / "out"
    done = _weir("prep", str(tmp_path / "bad.jsonl"), "--out", str(out), "--spec", "qwen3_vl", "--workers", "1")
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "report.json").read_text())
    assert [(r["line"], r["code"]) for r in report["bad_rows"]] == [(2, "invalid_utf8")]
    done = _weir("prep", str(tmp_path / "big.csv"), "--out", str(out), "--spec", "qwen3_vl", "--workers", "1")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert json.loads((out / "report.json").read_text())["rows"] == 1
    home = tmp_path / "home"
    for dataset, code in (("bad.jsonl", "invalid_utf8"), ("card", "invalid_dataset_card")):
        done = _weir("train", "--dataset", str(tmp_path / dataset), "--home", str(home))
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert f"[{code}]" in done.stderr
    done = _weir("prep", str(tmp_path / "card"), "--out", str(out))
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "README.md" in done.stderr and "[invalid_dataset_card]" in done.stderr
    assert not home.exists()
