"""Prometheus `/metrics` for roles whose figures are read at scrape time (no counters to keep in step).

`scrape_route(app, read)` adds ``GET /metrics``: ``read()`` returns ``{name: (help, value)}`` or
``{name: (help, {label_value: value}, label_name)}`` and is called per scrape, so the numbers are always the
role's own (the data role's durable counts, the engine's busy time).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["scrape_route"]

Reading = Mapping[str, tuple[Any, ...]]


class _Scrape(Collector):
    def __init__(self, read: Callable[[], Reading]) -> None:
        self.read = read

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for name, entry in self.read().items():
            if len(entry) == 2:
                help_text, value = entry
                yield GaugeMetricFamily(name, help_text, value=float(value))
            else:
                help_text, values, label = entry
                family = GaugeMetricFamily(name, help_text, labels=[label])
                for key, value in values.items():
                    family.add_metric([str(key)], float(value))
                yield family


def scrape_route(app: FastAPI, read: Callable[[], Reading]) -> None:
    registry = CollectorRegistry()
    registry.register(_Scrape(read))

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
