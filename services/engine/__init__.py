"""The engine role: one generation engine (`engines`) behind SGLang's HTTP API."""

from __future__ import annotations

from .app import create_app
from .settings import EngineSettings

__all__ = ["EngineSettings", "create_app"]
