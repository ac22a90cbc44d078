"""The encoder role: feature keys → cached embeddings from the model's own towers (see `app.py`)."""

from __future__ import annotations

from .app import create_app
from .settings import EncoderSettings

__all__ = ["EncoderSettings", "create_app"]
