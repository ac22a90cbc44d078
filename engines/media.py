"""Media passed by cache key → `MediaInput`: features from the shared feature cache, or embeddings
from the encoder role's cache (with the features' geometry, which the model's positions need).

The engine role's ``weir_media`` references arrive here as the wire's own records (`engines.api.MediaRef`),
in prompt order. This module reads the caches; it never decodes media (the preprocess role did) nor runs
the towers (the backend does, for references by feature key).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

import preprocess as pp
from encoders.embeddings import embedding_from_arrow
from preprocess.api import MediaKind

from .api import MediaRef
from .errors import InvalidMedia, MediaNotFound
from .protocol import MediaInput

__all__ = ["MediaKind", "MediaResolver"]


class MediaResolver:
    """The two caches an engine reads media from."""

    def __init__(self, features: pp.FeatureStore, embeddings: pp.FeatureStore) -> None:
        self.features = features
        self.embeddings = embeddings

    @classmethod
    def open(cls, cache_dir: str | Path, embedding_cache_dir: str | Path, max_bytes: int) -> MediaResolver:
        return cls(pp.FeatureStore(cache_dir, max_bytes), pp.FeatureStore(embedding_cache_dir, max_bytes))

    def resolve(self, refs: Sequence[MediaRef]) -> tuple[MediaInput, ...]:
        """The media of a prompt, in order; `InvalidMedia` or `MediaNotFound` (with ``item``) for a bad one."""
        return tuple(self._one(index, ref) for index, ref in enumerate(refs))

    def _one(self, index: int, ref: MediaRef) -> MediaInput:
        where = f"media item {index}"
        if (ref.feature_key is None) == (ref.embedding_key is None):
            raise InvalidMedia(f"{where}: give exactly one of feature_key, embedding_key", item=index)
        embedding = None
        feature_key = ref.feature_key
        if ref.embedding_key is not None:
            data = self.embeddings.get_bytes(ref.embedding_key)
            if data is None:
                raise MediaNotFound(
                    f"{where}: no embedding {ref.embedding_key}", code="embedding_not_found", item=index
                )
            values, meta = embedding_from_arrow(data)
            embedding, feature_key = torch.from_numpy(values.copy()), meta["feature_key"]
        features = self.features.get(str(feature_key))
        if features is None:
            raise MediaNotFound(f"{where}: no cached features {feature_key}", code="features_not_found", item=index)
        if features.kind != ref.type:
            raise InvalidMedia(f"{where}: {feature_key} is {features.kind}, not {ref.type}", item=index)
        item = MediaInput.of(features)
        if embedding is None:
            return item
        return MediaInput(
            kind=item.kind,
            embedding=embedding,
            grid_thw=item.grid_thw,
            second_per_grid_t=item.second_per_grid_t,
            audio_frames=item.audio_frames,
        )

    def close(self) -> None:
        self.features.close()
        self.embeddings.close()
