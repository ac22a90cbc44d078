"""The encoders library's one exception tree; each error carries a stable ``code``.

::

    EncoderError (ValueError)   base; ``code`` is machine-readable
    ├── FeaturesNotFound        a feature key is not in the feature cache (also a KeyError)
    └── TowerWeightsError            tower weights that are missing or do not fit the towers

The encoder role maps them to 404 and 400.
"""

from __future__ import annotations

from wire.errors import WeirError

__all__ = ["EncoderError", "FeaturesNotFound", "NoTower", "TowerWeightsError"]


class EncoderError(WeirError, ValueError):
    code = "encoder_error"


class FeaturesNotFound(EncoderError, KeyError):
    """``key`` has no features in the cache: preprocess it first (it may also have been evicted)."""

    code = "features_not_found"

    def __init__(self, key: str, *, item: int | None = None) -> None:
        super().__init__(f"no cached features {key}", item=item)
        self.key = key

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class TowerWeightsError(EncoderError):
    code = "bad_weights"


class NoTower(EncoderError):
    """The model has no tower for this medium (a text model has none at all, a vision-language model no audio)."""

    code = "no_tower"
