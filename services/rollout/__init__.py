"""The rollout role over HTTP: `create_app(settings)` (`app.py`); routes per resource (`rollouts`, `chat`,
`completions`, `models`, `rewards`), the rollout itself in `rollout`."""

from __future__ import annotations

from .app import create_app
from .settings import RolloutSettings

__all__ = ["RolloutSettings", "create_app"]
