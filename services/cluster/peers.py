"""Caches near each node: a miss in this node's feature or embedding cache is filled from another node's.

Each node keeps its own caches on local disk (``{node}`` in ``WEIR_CACHE_DIR`` /
``WEIR_EMBEDDING_CACHE_DIR`` becomes the node id). When an engine or encoder replica misses an item,
`PeerFill` asks the replicas that serve that cache on the other nodes (from the registry: preprocess
replicas for features, encoder replicas for embeddings) by content key — ``GET /v1/features/{key}`` or
``GET /v1/embeddings/{key}`` — and accepts a payload only when it is whole: its SHA-256 equals the
``X-Weir-Sha256`` header the owner sent, and it parses as what was asked for. Anything else is a miss,
and the caller's usual miss path runs (a 404 the rollout role answers by preprocessing again); a wrong
or partial entry is never stored.

Counted per node for the rollout role's report: local hits and misses live in each store; fetches
(served by a peer, or by none) are counted here.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable
from typing import Literal

import httpx

from ..template import DIGEST_HEADER
from .registry import ReplicaInfo

__all__ = ["Cache", "PeerFill"]

logger = logging.getLogger(__name__)

Cache = Literal["features", "embeddings"]
_OWNER_ROLE: dict[Cache, str] = {"features": "preprocess", "embeddings": "encoder"}
_PATH: dict[Cache, str] = {"features": "/v1/features/{key}", "embeddings": "/v1/embeddings/{key}"}


def _parses(cache: Cache, payload: bytes) -> bool:
    try:
        if cache == "features":
            from preprocess.features import features_from_arrow

            features_from_arrow(payload)
        else:
            from encoders.embeddings import embedding_from_arrow

            embedding_from_arrow(payload)
    except Exception:  # noqa: BLE001 - any failure to parse: not a whole entry
        return False
    return True


class PeerFill:
    """``fill(key)`` for one cache of one replica (`preprocess.FeatureStore.fill`)."""

    def __init__(
        self,
        cache: Cache,
        *,
        node: str,
        peers: Callable[[str], list[ReplicaInfo]],
        token: str | None,
        timeout_s: float = 30.0,
    ) -> None:
        self.cache, self.node, self._peers = cache, node, peers
        self._client = httpx.Client(timeout=timeout_s, headers={"Authorization": f"Bearer {token}"} if token else None)
        self._lock = threading.Lock()
        self.fetched = 0  # entries copied from another node
        self.unfound = 0  # misses no other node could fill

    def __call__(self, key: str) -> bytes | None:
        path = _PATH[self.cache].format(key=key)
        try:
            peers = self._peers(_OWNER_ROLE[self.cache])
        except Exception as error:  # noqa: BLE001 - the registry restarting: a miss, not a failed request
            logger.warning("no peer list for %s %s (%s): a miss", self.cache, key, error)
            peers = []
        for peer in peers:
            if peer["node"] == self.node:
                continue  # this node's own cache already missed
            try:
                response = self._client.get(f"{peer['url']}{path}")
            except httpx.HTTPError as error:
                logger.info("peer %s did not answer for %s %s: %s", peer["url"], self.cache, key, error)
                continue
            if response.status_code != 200:
                continue
            payload = response.content
            if response.headers.get(DIGEST_HEADER) != hashlib.sha256(payload).hexdigest() or not _parses(
                self.cache, payload
            ):
                logger.warning("peer %s sent a damaged %s entry for %s; ignored", peer["url"], self.cache, key)
                continue
            with self._lock:
                self.fetched += 1
            return payload
        with self._lock:
            self.unfound += 1
        return None

    def close(self) -> None:
        self._client.close()
