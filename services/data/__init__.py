"""The data role: `experience.ExperienceStore` over HTTP (routes in `app.py`, wire models in `schemas.py`,
settings in `settings.py`)."""

from __future__ import annotations

from .app import create_app
from .settings import DataSettings

__all__ = ["DataSettings", "create_app"]
