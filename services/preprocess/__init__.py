"""The preprocess role over HTTP: `create_app(settings)`; see `app.py`."""

from __future__ import annotations

from .app import create_app
from .settings import PreprocessSettings

__all__ = ["PreprocessSettings", "create_app"]
