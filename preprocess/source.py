"""Media sources: bytes, a path, or a binary file object, read once into memory.

The bytes are needed whole anyway — they are hashed for the cache key — so a source is read
once here and every later stage works on that buffer. Where a source may come from (allowed
roots, URLs) is the service's decision, not this module's.
"""

from __future__ import annotations

import hashlib
import io
import os
from typing import BinaryIO, Union

from .errors import EmptyMediaError, MediaTooLargeError

__all__ = ["MediaSource", "media_digest", "read_source"]

MediaSource = Union[bytes, bytearray, memoryview, str, os.PathLike, BinaryIO]


def read_source(source: MediaSource, *, max_bytes: int | None = None) -> bytes:
    """The source's bytes; `EmptyMediaError` for none, `MediaTooLargeError` over ``max_bytes``."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    elif isinstance(source, (str, os.PathLike)):
        size = os.path.getsize(source)
        if max_bytes is not None and size > max_bytes:
            raise MediaTooLargeError(f"{os.fspath(source)!r} is {size} bytes, over the limit of {max_bytes}")
        with open(source, "rb") as fh:
            data = fh.read()
    elif isinstance(source, io.IOBase) or hasattr(source, "read"):
        limit = -1 if max_bytes is None else max_bytes + 1
        data = source.read(limit)
        if not isinstance(data, bytes):
            raise TypeError("file objects must be opened in binary mode")
    else:
        raise TypeError(f"unsupported media source type {type(source).__name__}")
    if not data:
        raise EmptyMediaError("the media item is empty (0 bytes)")
    if max_bytes is not None and len(data) > max_bytes:
        raise MediaTooLargeError(f"the media item is over the limit of {max_bytes} bytes")
    return data


def media_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
