"""Prometheus metrics, one way for every role: a registry per app with the standard process
collectors, instruments the role updates as things happen, and figures read at scrape time.

Names follow Prometheus conventions: counters end in ``_total`` (prometheus_client adds it),
durations in ``_seconds``, sizes in ``_bytes``. `RoleMetrics.scraped` adds figures a role reads
from its own state when scraped (the data role's durable counts, the engine's busy time), each
declared as a counter or a gauge — never a counter exported as a gauge.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["CONTENT_TYPE_LATEST", "Figure", "RoleMetrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 120)


@dataclass(frozen=True, slots=True)
class Figure:
    """One figure read at scrape time: a value, or values by one label."""

    kind: Literal["counter", "gauge"]
    help: str
    value: float | Mapping[str, float]
    label: str = ""


class _Scraped(Collector):
    def __init__(self, read: Callable[[], Mapping[str, Figure]]) -> None:
        self.read = read

    def collect(self) -> Iterator[Metric]:
        for name, figure in self.read().items():
            family: CounterMetricFamily | GaugeMetricFamily
            labels = [figure.label] if figure.label else None
            if figure.kind == "counter":
                family = CounterMetricFamily(name.removesuffix("_total"), figure.help, labels=labels)
            else:
                family = GaugeMetricFamily(name, figure.help, labels=labels)
            if isinstance(figure.value, Mapping):
                for key, value in figure.value.items():
                    family.add_metric([str(key)], float(value))
            else:
                family.add_metric([], float(figure.value))
            yield family


class RoleMetrics:
    """The registry of one role's app (tests build many apps in one process, so never the global one)."""

    def __init__(self, role: str) -> None:
        # `_created` timestamps double every series and read as gauges named like counters; scrapers
        # know a counter's reset from its value going down.
        disable_created_metrics()
        self.role = role
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        for standard in (PLATFORM_COLLECTOR, GC_COLLECTOR):
            self.registry.register(_Reuse(standard))
        self.requests = self.counter("weir_http_requests", "HTTP requests by route and status", ["route", "status"])
        self.latency = self.histogram("weir_http_request_seconds", "HTTP request latency by route", ["route"])

    def counter(self, name: str, help_text: str, labels: Iterable[str] = ()) -> Counter:
        return Counter(name, help_text, list(labels), registry=self.registry)

    def gauge(self, name: str, help_text: str, labels: Iterable[str] = ()) -> Gauge:
        return Gauge(name, help_text, list(labels), registry=self.registry)

    def histogram(
        self, name: str, help_text: str, labels: Iterable[str] = (), buckets: tuple[float, ...] = _LATENCY_BUCKETS
    ) -> Histogram:
        return Histogram(name, help_text, list(labels), buckets=buckets, registry=self.registry)

    def scraped(self, read: Callable[[], Mapping[str, Figure]]) -> None:
        """Figures ``read()`` returns at each scrape, named in full (``..._total`` for counters)."""
        self.registry.register(_Scraped(read))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _Reuse(Collector):
    """A process-wide standard collector, also exported through a per-app registry."""

    def __init__(self, collector: Collector) -> None:
        self.collector = collector

    def collect(self) -> Iterable[Metric]:
        return self.collector.collect()
