"""Where a role may read media files from: the folders of ``WEIR_MEDIA_ROOTS``, and nowhere else.

One policy for every role that reads paths (the preprocess role's items, the engine role's SGLang
``image_data``): `MediaRoots` parses the setting (``/data/a:/data/b``, like ``PATH``) and `locate`
resolves a path under the roots with symlinks and ``..`` resolved, so nothing outside them is ever
opened. The roles word their own refusals (item index or field name); the rule is here. Media URLs
have their own one rule, `services.media_urls`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from pydantic import BeforeValidator
from pydantic_settings import NoDecode

__all__ = ["Located", "MediaRoots", "locate"]


def _split(value: object) -> object:
    return [p for p in value.split(":") if p] if isinstance(value, str) else value


MediaRoots = Annotated[list[Path], NoDecode, BeforeValidator(_split)]


@dataclass(frozen=True, slots=True)
class Located:
    file: Path | None  # the file, when one is under a root
    inside: bool  # the path names a place under some root (even if no file is there)


def locate(path: str, roots: Sequence[Path]) -> Located:
    """``path`` under ``roots``: an absolute path must resolve inside one; a relative one is tried under
    each root in turn. Symlinks are resolved before the check."""
    candidate = Path(path)
    inside = False
    for root in roots:
        base = root.resolve()
        target = (candidate if candidate.is_absolute() else base / candidate).resolve()
        if not target.is_relative_to(base):
            continue
        inside = True
        if target.is_file():
            return Located(target, True)
    return Located(None, inside)
