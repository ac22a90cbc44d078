"""SGLang's ``image_data`` / ``video_data`` / ``audio_data`` on `/generate`: raw media in, features of the
shared feature cache out, the prompt's placeholders expanded — the same features, keys and ids as Weir's
own ``weir_media`` path, so generation is the same.

Sources taken: a ``data:<mime>;base64,`` URI, bare base64, a ``file://`` URL or a path under one of
``WEIR_MEDIA_ROOTS`` (symlinks resolved, so ``..`` and links cannot leave the roots), and an
``http(s)://`` URL under the one URL rule of every role (`services.media_urls`: off unless
``WEIR_ALLOW_URLS``, public addresses only unless ``WEIR_ALLOW_PRIVATE_URLS``, the hosts of
``WEIR_MEDIA_URL_HOSTS`` when set, every redirect hop checked again), fetched as SGLang's loaders fetch
it (a GET, the body is the item) and cut at ``WEIR_MAX_MEDIA_BYTES`` (413 ``media_too_large``, as for
paths). Refusals name the field. No other scheme is fetched.

Placeholders (SGLang's rule for Qwen2.5-Omni): the prompt holds the item's placeholder token once
(``<|vision_bos|><|IMAGE|><|vision_eos|>``, ``<|VIDEO|>``, ``<|audio_bos|><|AUDIO|><|audio_eos|>``),
expanded here to the item's exact token count; ``input_ids`` may also come already expanded.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import preprocess as pp
from preprocess.placeholders import expand_placeholders

from ..errors import ApiError
from ..media_roots import locate
from ..media_urls import MediaUrls, fetch_url

__all__ = ["MEDIA_FIELDS", "BodyMedia", "MediaSources", "items_for", "read_media", "expand_prompt"]

MEDIA_FIELDS: Mapping[str, pp.MediaKind] = {"image_data": "image", "video_data": "video", "audio_data": "audio"}
BodyMedia = tuple[pp.MediaKind, str, str]  # (kind, source, field)
# A source with one of these suffixes is a path (base64 has no '.'), as SGLang's loaders read them.
_SUFFIXES = frozenset(
    {
        ".png",
        ".jpg",
        ".jpeg",
        ".webp",
        ".gif",
        ".bmp",
        ".mp4",
        ".webm",
        ".mkv",
        ".mov",
        ".avi",
        ".wav",
        ".mp3",
        ".flac",
        ".ogg",
    }
)


def items_for(body_fields: Mapping[str, Any], size: int, batch: bool) -> list[list[BodyMedia]]:
    """Each batch item's media sources, by kind: a single item, a list (one request's items), or, for a
    batch, a list of one entry (None, an item or a list) per prompt."""
    per_prompt: list[list[BodyMedia]] = [[] for _ in range(size)]
    for name, kind in MEDIA_FIELDS.items():
        value = body_fields.get(name)
        if value is None or value == []:
            continue
        if batch:
            if not isinstance(value, list) or len(value) != size:
                raise ApiError(400, "invalid_request", f"{name} needs one entry per prompt ({size})", field=name)
            entries = value
        else:
            entries = [value]
        for index, entry in enumerate(entries):
            sources = entry if isinstance(entry, list) else [] if entry is None else [entry]
            for source in sources:
                if isinstance(source, Mapping) and set(source) <= {"url", "content_hash"}:
                    source = source.get("url")  # SGLang 0.5.22's MediaRef object, without per-item options
                if not isinstance(source, str) or not source:
                    raise ApiError(
                        400,
                        "invalid_request",
                        f'{name}: each item is a string (a data URI, base64, file:// or a path) or {{"url": ...}}; '
                        "per-item options (min_pixels, fps, ...) are not taken",
                        field=name,
                    )
                per_prompt[index].append((kind, source, name))
    return per_prompt


@dataclass(frozen=True, slots=True)
class MediaSources:
    """Where raw media may come from (the engine settings' media fields): ``urls`` is the settings object
    itself (an `EngineSettings` is a `MediaUrls`)."""

    roots: Sequence[Path] = ()
    max_bytes: int = 128 << 20
    urls: MediaUrls = dataclass_field(default_factory=MediaUrls)  # URLs off unless given


def read_media(source: str, field: str, allowed: MediaSources) -> bytes:
    """The bytes of one SGLang media source (see the module's doc for what is taken)."""
    roots, max_bytes = allowed.roots, allowed.max_bytes
    scheme = urlsplit(source).scheme.lower() if "://" in source[:16] else ""
    if scheme in ("http", "https"):
        return fetch_url(source, allowed.urls, max_bytes, field=field)
    if source.startswith("data:"):
        header, sep, payload = source.partition(",")
        if not sep or not header.endswith(";base64"):
            raise ApiError(400, "bad_data_uri", f"{field}: data URIs must be data:<mime>;base64,<payload>", field=field)
        return _base64(payload, field, max_bytes)
    if scheme == "file":
        return _read_path(unquote(urlsplit(source).path), field, roots, max_bytes)
    if scheme:
        raise ApiError(400, "unsupported_media_source", f"{field}: {scheme}:// sources are not taken", field=field)
    if source.startswith(("/", "./", "../")) or (len(source) < 4096 and Path(source).suffix.lower() in _SUFFIXES):
        return _read_path(source, field, roots, max_bytes)
    return _base64(source, field, max_bytes)


def _base64(payload: str, field: str, max_bytes: int) -> bytes:
    if len(payload) > (max_bytes * 4) // 3 + 8:
        raise ApiError(413, "media_too_large", f"{field}: an item is over {max_bytes} bytes", field=field)
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(
            400, "bad_base64", f"{field}: not a path under the media roots nor base64", field=field
        ) from None


def _read_path(path: str, field: str, roots: Sequence[Path], max_bytes: int) -> bytes:
    if not roots:
        raise ApiError(403, "path_not_allowed", f"{field}: paths are off (no WEIR_MEDIA_ROOTS)", field=field)
    target = locate(path, roots).file
    if target is not None:
        if target.stat().st_size > max_bytes:
            raise ApiError(413, "media_too_large", f"{field}: {path!r} is over {max_bytes} bytes", field=field)
        return target.read_bytes()
    raise ApiError(403, "path_not_allowed", f"{field}: no file {path!r} under the media roots", field=field)


def expand_prompt(
    ids: list[int], placeholders: Mapping[str, int], items: Sequence[tuple[pp.MediaKind, int]], order: list[int]
) -> list[int]:
    """``ids`` with each item's placeholder expanded to its token count. ``items`` are per kind in the
    order given; ``order`` receives, in prompt order, the index of each item in ``items``. Ids already
    expanded (each kind's placeholder count equal to its items' tokens) are taken as they are."""
    by_kind: dict[str, list[int]] = {}
    for index, item in enumerate(items):
        by_kind.setdefault(item[0], []).append(index)
    counts = {kind: sum(1 for t in ids if t == token) for kind, token in placeholders.items()}
    expanded = all(counts[kind] == sum(items[i][1] for i in by_kind.get(kind, [])) for kind in placeholders) and any(
        counts.values()
    )
    if expanded:
        order.extend(_prompt_order(ids, placeholders, items, by_kind, collapsed=False))
        return list(ids)
    for kind in placeholders:
        if counts[kind] != len(by_kind.get(kind, [])):
            raise ApiError(
                400,
                "placeholder_mismatch",
                f"the prompt has {counts[kind]} {kind} placeholders for {len(by_kind.get(kind, []))} {kind} items",
                field=f"{kind}_data",
            )
    order.extend(_prompt_order(ids, placeholders, items, by_kind, collapsed=True))
    return expand_placeholders(ids, placeholders, [items[i] for i in order])


def _prompt_order(
    ids: list[int],
    placeholders: Mapping[str, int],
    items: Sequence[tuple[pp.MediaKind, int]],
    by_kind: dict[str, list[int]],
    *,
    collapsed: bool,
) -> list[int]:
    kind_of = {token: kind for kind, token in placeholders.items()}
    queues = {kind: list(indices) for kind, indices in by_kind.items()}
    order: list[int] = []
    position = 0
    while position < len(ids):
        kind = kind_of.get(ids[position])
        if kind is None:
            position += 1
            continue
        index = queues[kind].pop(0)
        order.append(index)
        position += 1 if collapsed else items[index][1]
    return order
