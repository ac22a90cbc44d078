"""A media item's kind, spelled ``type`` on every role's wire: the one definition (the preprocess, encoder, engine
and rollout records import it). Here, not in `preprocess.api`, so that what needs only the name (a rollout tool's
sandboxed worker, a script) does not load the preprocess library and torch with it."""

from __future__ import annotations

from typing import Literal

__all__ = ["MediaKind"]

MediaKind = Literal["image", "video", "audio"]
