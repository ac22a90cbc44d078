"""Where a request's media bytes may come from: inline base64 / data URI, or a path.

Safe by default: paths only under the configured roots (after resolving symlinks, so ``..`` and
links cannot escape; the rule is `services.media_roots`). URLs are fetched under the one URL rule of
every role, `services.media_urls` (off unless ``WEIR_ALLOW_URLS``; public addresses only unless
``WEIR_ALLOW_PRIVATE_URLS``; each hop connects to the addresses it checked, so DNS rebinding does not get
past it).
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path

from ..errors import ApiError
from ..media_roots import locate

__all__ = ["decode_inline", "read_path"]


def decode_inline(data: str, index: int, max_bytes: int) -> bytes:
    """Base64 or a ``data:<mime>;base64,<payload>`` URI."""
    payload = data
    if data.startswith("data:"):
        header, sep, payload = data.partition(",")
        if not sep or not header.endswith(";base64"):
            raise ApiError(
                400, "bad_data_uri", "data URIs must be of the form data:<mime>;base64,<payload>", item=index
            )
    if len(payload) > (max_bytes * 4) // 3 + 8:
        raise ApiError(413, "media_too_large", f"the item is over the limit of {max_bytes} bytes", item=index)
    try:
        raw = base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, "bad_base64", "the item's data is not valid base64", item=index) from None
    return raw


def read_path(path: str, roots: list[Path], index: int, max_bytes: int) -> bytes:
    """A file under one of ``roots``; relative paths are taken relative to each root in turn."""
    if not roots:
        raise ApiError(403, "path_not_allowed", "paths are disabled: no media roots are configured", item=index)
    found = locate(path, roots)
    if found.file is not None:
        size = found.file.stat().st_size
        if size > max_bytes:
            raise ApiError(413, "media_too_large", f"{path!r} is {size} bytes, over {max_bytes}", item=index)
        return found.file.read_bytes()
    if found.inside:
        raise ApiError(404, "media_not_found", f"no file at {path!r} under the media roots", item=index)
    raise ApiError(403, "path_not_allowed", f"{path!r} is outside the configured media roots", item=index)
