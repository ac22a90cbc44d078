"""The preprocess role's instruments, on its app's `RoleMetrics` registry (tests build many apps)."""

from __future__ import annotations

from collections.abc import Mapping

import preprocess as pp

from ..metrics import Figure, RoleMetrics

__all__ = ["PreprocessMetrics"]


class PreprocessMetrics:
    def __init__(self, metrics: RoleMetrics, store: pp.FeatureStore) -> None:
        self.tokens_planned = metrics.counter("weir_preprocess_tokens_planned", "Tokens planned from headers", ["type"])
        self.tokens_produced = metrics.counter(
            "weir_preprocess_tokens_produced", "Tokens of features produced or served", ["type"]
        )
        self.items_failed = metrics.counter("weir_preprocess_items_failed", "Items refused, by error code", ["code"])
        self.cache_hits = metrics.counter("weir_cache_hits", "Feature cache hits")
        self.cache_misses = metrics.counter("weir_cache_misses", "Feature cache misses")

        def cache() -> Mapping[str, Figure]:
            stats = store.stats()
            return {
                "weir_cache_bytes": Figure("gauge", "Bytes of published cache entries", stats.bytes),
                "weir_cache_entries": Figure("gauge", "Published cache entries", stats.entries),
                "weir_cache_evictions_total": Figure("counter", "Shards evicted by this process", stats.evictions),
            }

        metrics.scraped(cache)
