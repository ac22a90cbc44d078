"""What ``weir prep`` / ``weir train --dataset`` name, resolved to one split and read into rows, offline.

A dataset is one of:

* a file, read by its own reader: ``.jsonl`` (a JSON object a line), ``.json`` (an array of objects, or JSON
  Lines), ``.parquet``, ``.arrow`` (IPC stream or file) or ``.csv`` (a header line, then a row a line; the
  standard library's reader, for exact line numbers, fields of any size; values are strings, an empty one
  None, a nested column's JSON text decoded: ``messages``, ``reward``, ``reward_model``, …); the three text
  formats also compressed (``.jsonl.gz``, ``.csv.bz2``, ``.json.xz``: decompressed as they are read), UTF-8
  with or without a byte-order mark; another suffix is refused by name
  (``unknown_file_type``). A file is one split, ``train``;
* a folder ``datasets`` wrote with ``save_to_disk``: a ``Dataset`` (``state.json``; one split) or a
  ``DatasetDict`` (``dataset_dict.json``; a split is picked), read with ``datasets.load_from_disk``;
* any other folder, laid out as on the Hugging Face Hub: its splits are what ``datasets`` makes of it (its own
  code: the ``README.md`` YAML ``configs:`` / ``data_files`` — the default config, else the first — or file
  names: ``data/train-00000-of-00001.parquet``, ``test.jsonl``, ``validation/…``; files that name no split are
  all ``train``), each file read by the reader of its suffix;
* a hub dataset id ``owner/name`` that is no path here, read OFFLINE from the Hugging Face cache: the snapshot
  ``hf download --repo-type dataset`` (or any huggingface_hub download) left in ``HF_HUB_CACHE``, laid out as
  above, else the dataset ``load_dataset`` prepared in ``HF_DATASETS_CACHE`` (read as ``load_dataset`` reads
  it with ``HF_HUB_OFFLINE=1``). Nothing is downloaded; an id in neither is refused (``dataset_not_found``),
  as is one prepared there in several configs (``multiple_configs``, naming them).

The split is the one asked for (``--split``); asked for none, ``train`` where there are several, the one there
is where there is one. A split that does not exist is refused naming those that do (``unknown_split``).

A row that cannot be read — a line that is not UTF-8 (``invalid_utf8``), not JSON (``invalid_json``), JSON
that is not an object (``invalid_row``), a CSV line with more or fewer fields than the header
(``invalid_csv_row``) or that the CSV reader refuses (``invalid_csv``) — is a `BadRow` with its file, line
number and code, never a traceback; `DatasetSource.records` yields it in its place and `DatasetSource.rows`
raises it. A file that cannot be read at all is a `DatasetError` (``invalid_dataset``; a CSV header:
``invalid_csv`` / ``invalid_utf8``), as is a folder whose ``README.md`` YAML ``datasets`` cannot parse
(``invalid_dataset_card``) or that ``datasets`` cannot resolve otherwise (``invalid_dataset``). Every message
is one line.
"""

from __future__ import annotations

import bz2
import codecs
import csv
import gzip
import io
import json
import lzma
import re
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from dataclasses import replace as _replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, cast

from .errors import DatasetError

if TYPE_CHECKING:
    from datasets import Dataset, DatasetDict

__all__ = ["DATA_SUFFIXES", "BadRow", "DatasetSource", "Record", "Row", "is_hub_id", "open_dataset"]

DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow", ".csv")
# the text formats are read compressed too, decompressed as they are read (the columnar ones compress inside)
_TEXT_SUFFIXES = (".jsonl", ".json", ".csv")
_COMPRESSED = (".gz", ".bz2", ".xz")
_UNREADABLE = (OSError, EOFError, ValueError, zlib.error, lzma.LZMAError)  # ArrowInvalid, BadGzipFile, truncated
# csv's limit on one field (128 KiB by default) is process-wide: raised only while Weir's reader parses a row
_CSV_FIELD_LIMIT = 1 << 30
_UNDECODED = re.compile("[\udc80-\udcff]")  # a byte that is no UTF-8, as surrogateescape keeps it
# datasets' packaged builders of the formats above (the modules it infers a folder's files to be)
_MODULES = ("json", "parquet", "arrow", "csv")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def is_hub_id(text: str) -> bool:
    """``owner/name`` as the Hub spells a dataset id (and no data file's name: ``data/train.jsonl`` is a path)."""
    suffix = Path(text).suffix.lower()
    return _HUB_ID.fullmatch(text) is not None and suffix not in DATA_SUFFIXES and suffix not in _COMPRESSED


def _one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


@dataclass(frozen=True, slots=True, kw_only=True)
class BadRow:
    """A row that could not be read: where it is (its file, its line when it has one) and why (a stable code)."""

    file: str
    index: int  # the row's position in its file
    line: int | None  # the line of a JSONL / CSV file (1-based)
    code: str
    message: str

    @property
    def where(self) -> str:
        return f"{self.file} line {self.line}" if self.line is not None else f"{self.file} row {self.index}"

    def error(self) -> DatasetError:
        return DatasetError(f"{self.where}: {self.message}", code=self.code)


Row = dict[str, Any]  # a row as its file holds it: free-form
Record = Row | BadRow


@dataclass(frozen=True, slots=True, kw_only=True)
class DatasetSource:
    """One split of a dataset: its files (or a ``datasets.Dataset``) and where its relative media paths start."""

    name: str  # as given: a path or a hub id
    base: Path
    split: str
    files: tuple[Path, ...] = ()
    table: Dataset | None = None  # a datasets.Dataset (save_to_disk folders, datasets' cache), read as Arrow

    def records(self) -> Iterator[Record]:
        """Every row in order, a `BadRow` in the place of each one that cannot be read."""
        if self.table is not None:
            for batch in self.table.with_format("arrow").iter(batch_size=1024):
                yield from batch.to_pylist()
            return
        for file in self.files:
            yield from _file_records(file)

    def rows(self) -> Iterator[Row]:
        """Every row in order; the first that cannot be read raises its `DatasetError`."""
        for record in self.records():
            if isinstance(record, BadRow):
                raise record.error()
            yield record


def open_dataset(dataset: Path | str, split: str | None = None) -> DatasetSource:
    """``dataset`` (a path or a hub id) resolved to ``split`` (see the module's docstring); `DatasetError`
    when it cannot be: no such path or cached id, an unknown file type, no such split."""
    path = Path(dataset)
    if path.is_file():
        _format(path)
        return DatasetSource(
            name=str(dataset), base=path.resolve().parent, split=_pick(path, ["train"], split), files=(path,)
        )
    if path.is_dir():
        return _folder(path, split, name=str(dataset))
    if is_hub_id(str(dataset)):
        return _hub(str(dataset), split)
    raise DatasetError(f"{dataset}: no such file or folder", code="dataset_not_found")


def _pick(name: object, splits: list[str], split: str | None) -> str:
    """``split``, or with none asked for ``train`` (the only split where there is one); else `DatasetError`."""
    if split is None and len(splits) == 1:
        return splits[0]
    want = split or "train"
    if want not in splits:
        raise DatasetError(
            f"{name} has no split {want!r}: its splits are {', '.join(splits) or 'none'} (--split names one)",
            code="unknown_split",
        )
    return want


def _format(file: Path) -> tuple[str, str]:
    """A data file's format (``.jsonl``, …) and compression (``.gz``, ``.bz2``, ``.xz``, or ""); `DatasetError`
    (``unknown_file_type``, naming the suffix) for a file of another suffix."""
    suffix, inner = file.suffix.lower(), Path(file.stem).suffix.lower()
    if suffix in DATA_SUFFIXES:
        return suffix, ""
    if suffix in _COMPRESSED and inner in _TEXT_SUFFIXES:
        return inner, suffix
    named = inner + suffix if inner in DATA_SUFFIXES else suffix
    raise DatasetError(
        f"{file}: a {named or 'suffix-less'} file is no dataset Weir reads ({', '.join(DATA_SUFFIXES)}; "
        f"{', '.join(_TEXT_SUFFIXES)} also compressed {'/'.join(_COMPRESSED)}; or a folder of them)",
        code="unknown_file_type",
    )


def _folder(folder: Path, split: str | None, *, name: str) -> DatasetSource:
    base = folder.resolve()
    if (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file():
        from datasets import DatasetDict

        saved = _load_from_disk(folder)
        if isinstance(saved, DatasetDict):
            chosen = _pick(name, [str(s) for s in saved], split)
            return DatasetSource(name=name, base=base, split=chosen, table=saved[chosen])
        chosen = _pick(name, [str(saved.split or "train")], split)
        return DatasetSource(name=name, base=base, split=chosen, table=saved)
    splits = _data_files(folder)
    chosen = _pick(name, list(splits), split)
    return DatasetSource(name=name, base=base, split=chosen, files=tuple(Path(f) for f in splits[chosen]))


def _load_from_disk(folder: Path) -> Dataset | DatasetDict:
    import datasets

    try:
        return datasets.load_from_disk(str(folder))
    except (FileNotFoundError, ValueError, OSError, KeyError) as error:
        raise DatasetError(f"{folder}: a save_to_disk folder datasets cannot load: {error}") from None


def _data_files(folder: Path) -> dict[str, list[str]]:
    """The files of each split, as ``load_dataset(folder)`` resolves them (README ``configs:``, else names)."""
    from datasets.data_files import DataFilesPatternsDict
    from datasets.load import LocalDatasetModuleFactory

    try:
        module = LocalDatasetModuleFactory(str(folder)).get_module()
    except Exception as error:  # noqa: BLE001 — a card it cannot parse, EmptyDatasetError, no data files, mixed
        raise _unresolved(folder, error) from None
    kind = module.module_path.rsplit(".", 1)[-1]
    parameters = module.builder_configs_parameters
    if kind not in _MODULES:  # e.g. rows next to more images than rows files: the rows files, split as named
        rows_files = None if parameters.metadata_configs else _rows_files(folder)
        if rows_files is None:
            raise DatasetError(
                f"{folder}: its data files are {kind} files; Weir reads {', '.join(DATA_SUFFIXES)}",
                code="unknown_file_type",
            )
        return rows_files
    configs = {c.name: c for c in parameters.builder_configs or []}
    config = configs.get(parameters.default_config_name or "") or next(iter(configs.values()))
    data_files = config.data_files or {}
    if isinstance(data_files, DataFilesPatternsDict):  # README configs: patterns, resolved as the builder does
        base = folder.resolve() / (config.data_dir or "")
        try:
            data_files = data_files.resolve(base_path=base.as_posix())
        except FileNotFoundError as error:
            raise DatasetError(f"{folder}: its README.md configs name no files here ({_one_line(error)})") from None
    files = {str(s): [str(f) for f in fs] for s, fs in data_files.items()}
    for paths in files.values():
        for file in paths:
            _format(Path(file))
    return files


def _unresolved(folder: Path, error: Exception) -> DatasetError:
    """Why ``datasets`` could not resolve ``folder``: its dataset card (``README.md``'s YAML header, or
    ``.huggingface.yaml``) when that is what fails to parse, else the folder."""
    import yaml
    from datasets.utils.metadata import MetadataConfigs
    from huggingface_hub import DatasetCard

    card = folder / "README.md"
    try:
        if isinstance(error, yaml.YAMLError) and not card.is_file():
            card = folder / ".huggingface.yaml"
            raise error
        if card.is_file():
            MetadataConfigs.from_dataset_card_data(DatasetCard.load(card).data)
    except Exception as bad:  # noqa: BLE001 — YAML errors, a configs: section of the wrong shape
        return DatasetError(
            f"{card}: a dataset card datasets cannot read ({_one_line(bad)})", code="invalid_dataset_card"
        )
    return DatasetError(f"{folder}: no dataset datasets can resolve ({_one_line(error)})")


def _rows_files(folder: Path) -> dict[str, list[str]] | None:
    """The files of each split among those Weir reads, split as ``datasets`` splits files by name; None: none."""
    from datasets.data_files import DataFilesDict, get_data_patterns

    base = folder.resolve().as_posix()
    try:
        found = DataFilesDict.from_patterns(get_data_patterns(base), base_path=base, allowed_extensions=DATA_SUFFIXES)
    except FileNotFoundError:
        return None
    return {str(s): [str(f) for f in fs] for s, fs in found.items() if fs} or None


def _hub(repo_id: str, split: str | None) -> DatasetSource:
    """A hub id from the Hugging Face cache, never the network: huggingface_hub's snapshot, else datasets'."""
    from huggingface_hub import constants, snapshot_download

    try:
        snapshot = Path(snapshot_download(repo_id, repo_type="dataset", local_files_only=True))
    except Exception:  # noqa: BLE001 — LocalEntryNotFoundError, IncompleteSnapshotError: not (all) there
        snapshot = None
    if snapshot is not None:
        return _folder(snapshot, split, name=repo_id)
    prepared = _prepared(repo_id)
    if prepared is None:
        import datasets

        raise DatasetError(
            f"{repo_id}: no such file or folder, nor a dataset in the Hugging Face cache ({constants.HF_HUB_CACHE}, "
            f"{datasets.config.HF_DATASETS_CACHE}); Weir reads hub datasets offline: download it first "
            f"(`hf download --repo-type dataset {repo_id}`)",
            code="dataset_not_found",
        )
    chosen = _pick(repo_id, list(prepared), split)
    return DatasetSource(name=repo_id, base=Path.cwd(), split=chosen, table=prepared[chosen])


def _prepared(repo_id: str) -> DatasetDict | None:
    """The DatasetDict ``load_dataset(repo_id)`` prepared in datasets' cache, loaded as with ``HF_HUB_OFFLINE=1``
    (datasets then looks nowhere else); None when there is none."""
    import datasets

    offline = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = True
    try:
        return datasets.load_dataset(repo_id)
    except Exception:  # noqa: BLE001 — ConnectionError / FileNotFoundError / ValueError: not cached, or several
        configs = _cached_configs(repo_id)
    finally:
        datasets.config.HF_HUB_OFFLINE = offline
    if len(configs) > 1:  # load_dataset's "multiple configurations in the cache": Weir takes no config name
        raise DatasetError(
            f"{repo_id}: prepared in the Hugging Face cache in several configs ({', '.join(configs)}); Weir reads a "
            f"dataset of one: save the one wanted (`datasets.load_dataset({repo_id!r}, {configs[0]!r})"
            ".save_to_disk(DIR)`) and name DIR",
            code="multiple_configs",
        )
    return None


def _cached_configs(repo_id: str) -> list[str]:
    """The configs of ``repo_id`` prepared in datasets' cache (its ``owner___name/<config>/`` folders)."""
    import datasets

    folder = Path(datasets.config.HF_DATASETS_CACHE) / repo_id.replace("/", "___")
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def _open(file: Path, compression: str) -> BinaryIO:
    """``file``'s bytes, decompressed as they are read; the caller closes it."""
    if compression == ".gz":
        return cast(BinaryIO, gzip.open(file, "rb"))  # noqa: SIM115
    if compression == ".bz2":
        return cast(BinaryIO, bz2.open(file, "rb"))  # noqa: SIM115
    if compression == ".xz":
        return cast(BinaryIO, lzma.open(file, "rb"))  # noqa: SIM115
    return file.open("rb")


def _file_records(file: Path) -> Iterator[Record]:
    suffix, compression = _format(file)
    try:
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            for batch in pq.ParquetFile(file).iter_batches(batch_size=1024):
                yield from batch.to_pylist()
        elif suffix == ".arrow":
            yield from _arrow_rows(file)
        elif suffix == ".csv":
            yield from _csv_records(file, compression)
        elif suffix == ".json" and _starts_an_array(file, compression):
            yield from _json_array_records(file, compression)
        else:
            yield from _json_lines_records(file, compression)
    except _UNREADABLE as error:  # pyarrow's ArrowInvalid is a ValueError; gzip's BadGzipFile an OSError
        if isinstance(error, DatasetError):
            raise
        kind = (suffix + compression)[1:]
        raise DatasetError(f"{file}: not a {kind} file Weir can read ({_one_line(error)})") from None


def _starts_an_array(file: Path, compression: str) -> bool:
    """Whether a ``.json`` file is one array (else it is read as JSON Lines, as ``datasets`` reads both)."""
    with _open(file, compression) as fh:
        head = b""
        while chunk := fh.read(4096):
            head = (head + chunk).removeprefix(codecs.BOM_UTF8).lstrip()
            if head:
                return head.startswith(b"[")
    return False


def _arrow_rows(path: Path) -> Iterator[Row]:
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        try:  # `datasets` writes the IPC stream format; a file written with pyarrow's file format is read too
            reader: pa.ipc.RecordBatchStreamReader | pa.ipc.RecordBatchFileReader = pa.ipc.open_stream(source)
            batches: Iterator[pa.RecordBatch] = iter(reader)
        except pa.ArrowInvalid:
            source.seek(0)
            file_reader = pa.ipc.open_file(source)
            batches = (file_reader.get_batch(i) for i in range(file_reader.num_record_batches))
        for batch in batches:
            yield from batch.to_pylist()


def _object(value: object, file: Path, index: int, line: int | None) -> Record:
    if isinstance(value, dict):
        return value
    return BadRow(
        file=file.name,
        index=index,
        line=line,
        code="invalid_row",
        message=f"a JSON {type(value).__name__}, not an object (a row is one)",
    )


def _json_lines_records(file: Path, compression: str) -> Iterator[Record]:
    """Each line decoded on its own: a byte that is no UTF-8 makes its line a `BadRow`, not the file."""
    index = 0
    with _open(file, compression) as fh:
        for number, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as error:
                yield BadRow(
                    file=file.name,
                    index=index,
                    line=number,
                    code="invalid_utf8",
                    message=f"not UTF-8 (byte {raw[error.start : error.start + 1]!r} at column {error.start + 1})",
                )
                index += 1
                continue
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as error:
                yield BadRow(
                    file=file.name,
                    index=index,
                    line=number,
                    code="invalid_json",
                    message=f"not JSON ({error.msg} at column {error.colno})",
                )
            else:
                yield _object(value, file, index, number)
            index += 1


def _json_array_records(file: Path, compression: str) -> Iterator[Record]:
    with _open(file, compression) as fh:
        data = fh.read()
    try:
        values = json.loads(data.decode("utf-8-sig"))
    except UnicodeDecodeError as error:
        raise DatasetError(f"{file}: not UTF-8 (byte {error.start + 1})", code="invalid_utf8") from None
    except json.JSONDecodeError as error:
        raise DatasetError(f"{file}: not JSON ({error})") from None
    for index, value in enumerate(values):
        yield _object(value, file, index, None)


@contextmanager
def _csv_field_limit() -> Iterator[None]:
    previous = csv.field_size_limit(_CSV_FIELD_LIMIT)
    try:
        yield
    finally:
        csv.field_size_limit(previous)


def _csv_lines(file: Path, compression: str) -> Iterator[tuple[int, list[str] | str]]:
    """Each CSV row with its first line (a quoted value may span lines), or why the reader refused it. Bytes
    that are no UTF-8 are kept as surrogates (`_UNDECODED`), so that only their row is refused."""
    with (
        _open(file, compression) as raw,
        io.TextIOWrapper(raw, encoding="utf-8-sig", errors="surrogateescape", newline="") as fh,
    ):
        reader = csv.reader(fh)
        start = 1
        while True:
            try:
                with _csv_field_limit():
                    fields: list[str] | str = next(reader)
            except StopIteration:
                return
            except csv.Error as error:
                fields = " ".join(str(error).split())
            line, start = start, reader.line_num + 1
            yield line, fields


def _csv_records(file: Path, compression: str) -> Iterator[Record]:
    lines = _csv_lines(file, compression)
    _, header = next(lines, (1, []))
    if isinstance(header, str):
        raise DatasetError(f"{file} line 1: a header the CSV reader refuses ({header})", code="invalid_csv")
    if any(_UNDECODED.search(name) for name in header):
        raise DatasetError(f"{file} line 1: a header that is not UTF-8", code="invalid_utf8")
    if not header:
        return
    index = 0
    for line, fields in lines:
        if not fields:
            continue
        bad = BadRow(file=file.name, index=index, line=line, code="invalid_csv_row", message="")
        if isinstance(fields, str):
            yield _replace(bad, code="invalid_csv", message=f"the CSV reader refuses it ({fields})")
        elif len(fields) != len(header):
            yield _replace(bad, message=f"{len(fields)} fields, the header has {len(header)}")
        elif any(_UNDECODED.search(value) for value in fields):
            yield _replace(bad, code="invalid_utf8", message="not UTF-8")
        else:
            row: dict[str, object] = {k: v if v != "" else None for k, v in zip(header, fields, strict=True)}
            nested = _nested(row)
            yield nested if nested is not None else _replace(bad, code="invalid_json", message="a nested cell not JSON")
        index += 1


# A CSV cell cannot nest, so the columns rows nest (Weir's ``messages``, ``reward``, ``environment``; verl's
# ``reward_model``, ``extra_info``, a ``prompt`` of messages) are read as JSON where their text is an object or array.
_NESTED = ("messages", "reward", "environment", "reward_model", "extra_info")


def _nested(row: dict[str, object]) -> dict[str, object] | None:
    """The row with its nested cells decoded; None when one of them is not JSON."""
    for name, value in row.items():
        if not isinstance(value, str) or value[:1] not in ("{", "["):
            continue
        try:
            decoded = json.loads(value)
        except ValueError:
            if name in _NESTED:
                return None
            continue  # a prompt that only starts with a bracket is text
        if name in _NESTED or (
            name == "prompt" and isinstance(decoded, list) and all(isinstance(m, dict) for m in decoded)
        ):
            row[name] = decoded
    return row
