"""Datasets whose rows reference media: JSONL or Parquet, read into lists of media references.

A row may name media in columns (``image``/``images``, ``video``/``videos``, ``audio``/``audios``:
a path or a list of paths) or in OpenAI-style ``messages`` whose content parts are ``image_url``,
``video_url``, ``audio_url`` (a path, ``file://`` URL or data URI), ``input_audio`` (base64 data)
or Qwen-style ``{"type": "image", "image": path}``. Relative paths are relative to the dataset
file. This module resolves references; it does not decode media.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import MediaError
from .probe import MediaKind

__all__ = ["MediaRef", "iter_rows", "row_media"]

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


@dataclass(frozen=True, slots=True, kw_only=True)
class MediaRef:
    kind: MediaKind
    source: str  # a path, or "<inline>" for embedded data
    path: Path | None = None
    data: bytes | None = None

    def read(self) -> bytes:
        if self.data is not None:
            return self.data
        assert self.path is not None
        if not self.path.is_file():
            raise MediaError(f"no file at {self.path}", code="media_not_found")
        return self.path.read_bytes()


def iter_rows(path: Path) -> Iterator[dict[str, Any]]:
    """Rows of a ``.jsonl`` / ``.json`` (array) / ``.parquet`` file."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            yield from batch.to_pylist()
    elif suffix == ".json":
        yield from json.loads(path.read_text())
    else:
        with path.open() as fh:
            for line in fh:
                if line.strip():
                    yield json.loads(line)


def _ref(kind: MediaKind, value: str, base: Path) -> MediaRef:
    if value.startswith("data:"):
        header, _, payload = value.partition(",")
        try:
            return MediaRef(kind=kind, source="<inline>", data=base64.b64decode(payload, validate=True))
        except (binascii.Error, ValueError):
            return MediaRef(kind=kind, source="<inline>", data=b"")
    if value.startswith(("http://", "https://")):
        raise MediaError(f"URLs are not fetched by the dataset job: {value[:80]}", code="url_not_supported")
    path = Path(value.removeprefix("file://"))
    return MediaRef(kind=kind, source=value, path=path if path.is_absolute() else base / path)


def _part_value(part: dict[str, Any], key: str) -> str | None:
    value = part.get(key)
    if isinstance(value, dict):
        value = value.get("url")
    return value if isinstance(value, str) else None


def row_media(row: dict[str, Any], base: Path) -> list[MediaRef]:
    """The media a row references, in order: columns first, then message parts."""
    refs: list[MediaRef] = []
    for column, kind in _COLUMNS.items():
        value = row.get(column)
        values = value if isinstance(value, list) else [value] if isinstance(value, str) else []
        refs.extend(_ref(kind, v, base) for v in values if isinstance(v, str))
    for message in row.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else []:
            part_kind = _PARTS.get(str(part.get("type")))
            if part_kind is not None:
                value = _part_value(part, part["type"])
                if value is not None:
                    refs.append(_ref(part_kind, value, base))
            elif part.get("type") == "input_audio":
                audio = part.get("input_audio") or {}
                try:
                    data = base64.b64decode(audio.get("data", ""), validate=True)
                except (binascii.Error, ValueError):
                    data = b""
                refs.append(MediaRef(kind="audio", source="<inline>", data=data))
    return refs
