"""What one data-role app owns (``app.state.weir``): the experience store, the feature cache for inline
media, the role's settings. `app.create_app` builds it; routes read it through `deps`.
"""

from __future__ import annotations

from dataclasses import dataclass

import preprocess as pp
from experience import ExperienceStore

from .settings import DataSettings

__all__ = ["DataState"]


@dataclass(frozen=True, slots=True, kw_only=True)
class DataState:
    """What one app instance owns (``app.state.weir``)."""

    store: ExperienceStore
    features: pp.FeatureStore | None  # the feature cache, for inline media
    settings: DataSettings
