"""Prometheus metrics of the preprocess role, on a registry per app (tests build many apps)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["PreprocessMetrics"]


class PreprocessMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "weir_preprocess_requests",
            "Requests by endpoint and status",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "weir_preprocess_request_seconds",
            "Request latency by endpoint",
            ["endpoint"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=self.registry,
        )
        self.tokens_planned = Counter(
            "weir_preprocess_tokens_planned", "Tokens planned from headers", ["type"], registry=self.registry
        )
        self.tokens_produced = Counter(
            "weir_preprocess_tokens_produced", "Tokens of features produced or served", ["type"], registry=self.registry
        )
        self.items_failed = Counter(
            "weir_preprocess_items_failed", "Items refused, by error code", ["code"], registry=self.registry
        )
        self.cache_hits = Counter("weir_cache_hits", "Feature cache hits", registry=self.registry)
        self.cache_misses = Counter("weir_cache_misses", "Feature cache misses", registry=self.registry)
        self.cache_bytes = Gauge("weir_cache_bytes", "Bytes of published cache entries", registry=self.registry)
        self.cache_entries = Gauge("weir_cache_entries", "Published cache entries", registry=self.registry)
        self.cache_evictions = Gauge("weir_cache_evictions", "Shards evicted by this process", registry=self.registry)
