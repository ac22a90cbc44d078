"""The encoder stage with its cache: feature keys in, embedding keys out, one forward per unique item.

Embeddings are cached in the same Arrow-shard store as features (`preprocess.FeatureStore`), keyed
by feature key + tower-weights version: a frozen tower computes each unique media item once,
however many samples and steps use it; new tower weights give a new version and fresh entries.
"""

from __future__ import annotations

import hashlib
import json
from typing import TypedDict

import numpy as np
import pyarrow as pa
import torch

import preprocess as pp

from .api import EncodedItem
from .errors import FeaturesNotFound
from .towers import Towers

__all__ = ["EmbeddingMeta", "Encoder", "embedding_from_arrow", "embedding_key", "embedding_to_arrow"]

_META = b"weir"


def embedding_key(feature_key: str, version: str) -> str:
    return hashlib.sha256(f"{feature_key}|{version}".encode()).hexdigest()[:40]


class EmbeddingMeta(TypedDict):
    """What an embedding's Arrow stream says of itself (JSON under ``weir``)."""

    kind: str  # the media kind of the features it embeds
    feature_key: str
    version: str  # the towers' version that made it
    shape: list[int]  # (tokens, hidden)


def embedding_to_arrow(embedding: np.ndarray, meta: EmbeddingMeta) -> bytes:
    """(tokens, hidden) float32 as one Arrow IPC stream with its metadata."""
    rows = np.ascontiguousarray(embedding, dtype=np.float32)
    column = pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1)), rows.shape[1])
    batch = pa.record_batch([column], names=["embedding"])
    schema = batch.schema.with_metadata({_META: json.dumps(meta)})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        writer.write_batch(batch.replace_schema_metadata(schema.metadata))
    return sink.getvalue().to_pybytes()


def embedding_from_arrow(data: bytes | pa.Buffer) -> tuple[np.ndarray, EmbeddingMeta]:
    """Zero-copy (tokens, hidden) float32 view and the metadata."""
    reader = pa.ipc.open_stream(data if isinstance(data, pa.Buffer) else pa.py_buffer(data))
    batch = reader.read_next_batch()
    column = batch.column(0)
    values = column.values.to_numpy(zero_copy_only=True).reshape(len(column), -1)
    return values, json.loads(reader.schema.metadata[_META])


class Encoder:
    """Towers + two stores: where features are read from, and where embeddings are kept."""

    def __init__(self, towers: Towers, features: pp.FeatureStore, embeddings: pp.FeatureStore) -> None:
        self.towers, self.features, self.embeddings = towers, features, embeddings

    def encode(self, feature_keys: list[str]) -> list[EncodedItem]:
        """Embed each key (computing only the misses, in packed batches), each as the encoder role answers it
        (`encoders.api.EncodedItem`); raises `FeaturesNotFound` (naming the key and its position) for a key
        the feature cache does not hold."""
        version = self.towers.version
        results: list[EncodedItem | None] = [None] * len(feature_keys)
        misses: dict[str, list[int]] = {}  # feature key → positions (a key may repeat)
        loaded: dict[str, pp.Features] = {}
        for i, key in enumerate(feature_keys):
            emb_key = embedding_key(key, version)
            cached = self.embeddings.get_bytes(emb_key)
            if cached is not None:
                _, meta = embedding_from_arrow(cached)
                tokens, hidden = meta["shape"]
                results[i] = EncodedItem(
                    feature_key=key,
                    embedding_key=emb_key,
                    type=meta["kind"],  # type: ignore[arg-type]  # validated by the record
                    shape=[tokens, hidden],
                    cache_hit=True,
                )
                continue
            if key not in loaded:
                features = self.features.get(key)
                if features is None:
                    raise FeaturesNotFound(key, item=i)
                loaded[key] = features
            misses.setdefault(key, []).append(i)
        keys = list(misses)
        for key, embedding in zip(keys, self.towers.encode([loaded[k] for k in keys]), strict=True):
            array = embedding.float().cpu().numpy()
            meta = {
                "kind": loaded[key].kind,
                "feature_key": key,
                "version": version,
                "shape": list(array.shape),
            }
            emb_key = embedding_key(key, version)
            self.embeddings.put(emb_key, embedding_to_arrow(array, meta))
            for i in misses[key]:
                results[i] = EncodedItem(
                    feature_key=key,
                    embedding_key=emb_key,
                    type=loaded[key].kind,
                    shape=[int(array.shape[0]), int(array.shape[1])],
                    cache_hit=False,
                )
        return [r for r in results if r is not None]

    def embedding(self, embedding_key: str) -> torch.Tensor | None:
        data = self.embeddings.get_bytes(embedding_key)
        if data is None:
            return None
        values, _ = embedding_from_arrow(data)
        return torch.from_numpy(values.copy())
