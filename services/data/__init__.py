"""The data role: `experience.ExperienceStore` over HTTP (`app.py` assembles; routes in `experience.py`,
`microbatches.py` and `policy.py`, reading `state.py`'s `DataState` through `deps.py`; settings in `settings.py`;
its wire records are `experience.api`'s, its callers' client `experience.client`)."""

from __future__ import annotations

from .app import create_app
from .settings import DataSettings

__all__ = ["DataSettings", "create_app"]
