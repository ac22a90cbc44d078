"""Datasets whose rows reference media: files and folders read into rows, rows into lists of media references.

A dataset is a file (``.jsonl`` / ``.json`` / ``.parquet`` / ``.arrow`` / ``.csv``), a folder ``datasets``
wrote with ``save_to_disk`` (a ``Dataset``, or a ``DatasetDict`` of which one split is read), a folder laid out
as on the Hugging Face Hub (its splits as ``datasets`` resolves them: ``README.md`` ``configs:``, else file names
such as ``data/train-00000-of-00001.parquet``) or a hub id ``owner/name`` read offline from the Hugging Face
cache: `preprocess.reading` resolves which and reads it, a row it cannot read (``invalid_utf8``, ``invalid_json``,
``invalid_row``, ``invalid_csv_row``, ``invalid_csv``) reported with its line number. Relative media paths are
relative to the dataset's folder (a file's own folder).

A row may name media in columns (``image``/``images``, ``video``/``videos``, ``audio``/``audios``: one value or
a list) or in OpenAI-style ``messages`` whose content parts are ``image_url``, ``video_url``, ``audio_url`` (a
path, ``file://`` URL or data URI), ``input_audio`` (base64 data) or Qwen-style ``{"type": "image", "image":
path}``. A column value is a path or data URI, raw bytes, a Hugging Face ``Image`` / ``Audio`` struct
(``{"bytes", "path"}``: the bytes when present, else the path) or a decoded ``Audio`` (``{"array",
"sampling_rate"}``, written out as 16-bit WAV). verl / slime rows (a ``prompt``, no ``messages``) bind their
columns to the ``<image>`` / ``<video>`` / ``<audio>`` markers of the prompt, in order; a count that
differs is a `DatasetError` (``marker_mismatch``), as is any value of another shape. This module resolves
references; it does not decode media, nor turn rows into rollout prompts (`preprocess.rows` does).
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import wave
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import DatasetError
from .probe import MediaKind
from .reading import Row, open_dataset

__all__ = [
    "MARKERS",
    "RowMedia",
    "column_values",
    "dataset_base",
    "iter_rows",
    "media_ref",
    "prompt_messages",
    "row_media",
]

_COLUMNS: dict[str, MediaKind] = {
    "image": "image",
    "images": "image",
    "video": "video",
    "videos": "video",
    "audio": "audio",
    "audios": "audio",
}
_PARTS: dict[str, MediaKind] = {
    "image_url": "image",
    "video_url": "video",
    "audio_url": "audio",
    "image": "image",
    "video": "video",
    "audio": "audio",
}
_KINDS: tuple[MediaKind, ...] = ("image", "video", "audio")
# verl's and slime's media markers in a prompt's text, each bound to the next item of its kind's column.
MARKERS = re.compile(r"<(image|video|audio)>")


@dataclass(frozen=True, slots=True, kw_only=True)
class RowMedia:
    """One media item of a dataset row: its kind and where its bytes are (a file, or the row's own data)."""

    kind: MediaKind
    source: str  # a path, or "<inline>" for embedded data
    path: Path | None = None
    data: bytes | None = None

    def read(self) -> bytes:
        if self.data is not None:
            return self.data
        assert self.path is not None
        if not self.path.is_file():
            raise DatasetError(f"no file at {self.path}", code="media_not_found")
        return self.path.read_bytes()


def dataset_base(path: Path | str, split: str | None = None) -> Path:
    """Where the dataset's relative media paths start: the folder a folder dataset is, else the file's folder
    (a hub id's: its snapshot in the Hugging Face cache)."""
    return open_dataset(path, split).base


def iter_rows(path: Path | str, split: str | None = None) -> Iterator[Row]:
    """The rows of ``split`` of the dataset at ``path`` (`preprocess.reading.open_dataset` reads which); a row
    that cannot be read raises its `DatasetError` (``DatasetSource.records`` yields it in its place instead)."""
    return open_dataset(path, split).rows()


def _ref(kind: MediaKind, value: str, base: Path) -> RowMedia:
    if value.startswith("data:"):
        header, _, payload = value.partition(",")
        try:
            return RowMedia(kind=kind, source="<inline>", data=base64.b64decode(payload, validate=True))
        except (binascii.Error, ValueError):
            return RowMedia(kind=kind, source="<inline>", data=b"")
    if value.startswith(("http://", "https://")):
        raise DatasetError(f"URLs are not fetched by the dataset job: {value[:80]}", code="url_not_supported")
    path = Path(value.removeprefix("file://"))
    return RowMedia(kind=kind, source=value, path=path if path.is_absolute() else base / path)


def _wav(array: object, rate: object) -> bytes:
    """A decoded Hugging Face ``Audio`` value as mono 16-bit PCM WAV (what `datasets` decodes is mono floats)."""
    samples = np.asarray(array, dtype=np.float32) if isinstance(array, list | np.ndarray) else None
    if samples is None or samples.ndim != 1 or isinstance(rate, bool) or not isinstance(rate, int) or rate <= 0:
        raise DatasetError(
            "a decoded audio value needs a 1-D 'array' of samples and an integer 'sampling_rate'",
            code="unsupported_media_value",
        )
    pcm = (np.clip(samples, -1.0, 1.0) * 32767).astype("<i2")
    out = io.BytesIO()
    with wave.open(out, "wb") as fh:
        fh.setnchannels(1)
        fh.setsampwidth(2)
        fh.setframerate(rate)
        fh.writeframes(pcm.tobytes())
    return out.getvalue()


def media_ref(kind: MediaKind, value: object, base: Path) -> RowMedia:
    """One column value: a path / ``file://`` URL / data URI, raw bytes, a Hugging Face ``Image`` / ``Audio``
    struct (its bytes when present, else its path) or a decoded ``Audio`` (``array`` + ``sampling_rate``)."""
    if isinstance(value, str):
        return _ref(kind, value, base)
    if isinstance(value, bytes | bytearray | memoryview):
        return RowMedia(kind=kind, source="<inline>", data=bytes(value))
    if isinstance(value, Mapping):
        data, path = value.get("bytes"), value.get("path")
        if isinstance(data, bytes | bytearray | memoryview) and data:
            return RowMedia(kind=kind, source=path if isinstance(path, str) and path else "<inline>", data=bytes(data))
        if isinstance(path, str) and path:
            return _ref(kind, path, base)
        if kind == "audio" and "array" in value:
            return RowMedia(kind=kind, source="<array>", data=_wav(value["array"], value.get("sampling_rate")))
        raise DatasetError(
            f"a {kind} value with neither bytes nor a path (keys: {sorted(map(str, value))})",
            code="unsupported_media_value",
        )
    raise DatasetError(f"a {kind} value of type {type(value).__name__}", code="unsupported_media_value")


def column_values(row: Mapping[str, object], kind: MediaKind) -> list[object]:
    """The values of ``kind``'s columns (``image`` then ``images``, …), None dropped."""
    values: list[object] = []
    for column, column_kind in _COLUMNS.items():
        value = row.get(column)
        if column_kind == kind and value is not None:
            values.extend(value if isinstance(value, list | tuple) else [value])
    return values


def prompt_messages(prompt: object) -> list[object]:
    """A verl / slime ``prompt`` as chat messages: a list of messages as given, a string as one user turn."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list | tuple):
        return list(prompt)
    raise DatasetError(f"'prompt' is a {type(prompt).__name__}: chat messages or a string", code="invalid_row")


def _marker_counts(messages: list[object]) -> dict[MediaKind, int]:
    counts: dict[MediaKind, int] = {"image": 0, "video": 0, "audio": 0}
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        texts = [content] if isinstance(content, str) else []
        if isinstance(content, list):
            texts = [p["text"] for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str)]
        for text in texts:
            for match in MARKERS.finditer(text):
                counts[_PARTS[match.group(1)]] += 1
    return counts


def _part_value(part: Mapping[str, object], key: str) -> str | None:
    value = part.get(key)
    if isinstance(value, Mapping):
        value = value.get("url")
    return value if isinstance(value, str) else None


def _part_refs(messages: object, base: Path) -> list[RowMedia]:
    refs: list[RowMedia] = []
    for message in messages if isinstance(messages, list | tuple) else []:
        content = message.get("content") if isinstance(message, Mapping) else None
        for part in content if isinstance(content, list) else []:
            kind = part.get("type") if isinstance(part, Mapping) else None
            if not isinstance(part, Mapping) or not isinstance(kind, str):
                continue
            part_kind = _PARTS.get(kind)
            if part_kind is not None:
                value = _part_value(part, kind)
                if value is not None:
                    refs.append(_ref(part_kind, value, base))
            elif kind == "input_audio":
                audio = part.get("input_audio")
                payload = audio.get("data") if isinstance(audio, Mapping) else None
                try:
                    data = base64.b64decode(payload if isinstance(payload, str) else "", validate=True)
                except (binascii.Error, ValueError):
                    data = b""
                refs.append(RowMedia(kind="audio", source="<inline>", data=data))
    return refs


def row_media(row: Mapping[str, object], base: Path) -> list[RowMedia]:
    """The media a row references, in order: columns first (images, videos, audios), then message parts.

    A verl / slime row (``prompt``, no ``messages``) must have as many items of each kind as its prompt has
    markers (`DatasetError` ``marker_mismatch`` otherwise); its media are its columns' and its prompt's parts."""
    columns = {kind: column_values(row, kind) for kind in _KINDS}
    messages: object = row.get("messages")
    if messages is None and "prompt" in row:
        messages = prompt_messages(row["prompt"])
        markers = _marker_counts(messages)
        for kind, values in columns.items():
            if markers[kind] != len(values):
                raise DatasetError(
                    f"the prompt has {markers[kind]} <{kind}> markers but the row has {len(values)} {kind}s",
                    code="marker_mismatch",
                )
    refs = [media_ref(kind, value, base) for kind, values in columns.items() for value in values]
    return refs + _part_refs(messages, base)
