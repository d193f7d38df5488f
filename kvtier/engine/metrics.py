"""The engine's metrics registry: Prometheus collectors owned by one engine.

Each engine owns its own `CollectorRegistry` (not prometheus_client's global one), so two engines
in one process (tests, a benchmark comparing configurations) never share or clash on series.
Connectors and tiers receive the registry (ConnectorContext.metrics) and register their own.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

# Samples that say nothing about the value (creation stamps, per-bucket counts).
_SKIPPED_SUFFIXES = ("_created", "_bucket")


class MetricsRegistry:
    """Creates collectors once by name; asking again for the same name returns the same one."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._collectors: dict[str, object] = {}
        self._lock = threading.Lock()

    def counter(self, name: str, doc: str, labelnames: Sequence[str] = ()) -> Counter:
        return self._get_or_create(Counter, name, doc, labelnames)

    def gauge(self, name: str, doc: str, labelnames: Sequence[str] = ()) -> Gauge:
        return self._get_or_create(Gauge, name, doc, labelnames)

    def histogram(self, name: str, doc: str, labelnames: Sequence[str] = (),
                  buckets: Sequence[float] = Histogram.DEFAULT_BUCKETS) -> Histogram:
        return self._get_or_create(Histogram, name, doc, labelnames, buckets=tuple(buckets))

    def _get_or_create(self, kind: type, name: str, doc: str, labelnames: Sequence[str],
                       **extra: object):
        with self._lock:
            existing = self._collectors.get(name)
            if existing is not None:
                if not isinstance(existing, kind) or \
                        tuple(existing._labelnames) != tuple(labelnames):
                    raise ValueError(f"metric {name!r} already exists with another type or "
                                     f"labels; pick another name")
                return existing
            collector = kind(name, doc, labelnames=tuple(labelnames), registry=self.registry,
                             **extra)
            self._collectors[name] = collector
            return collector

    def snapshot(self) -> dict[str, float]:
        """Current values by Prometheus sample name, labelled series as `name{label="v"}`.

        Counters appear under the exposed `_total` name and also under the family name
        (`vllm:prefix_cache_hits` and `vllm:prefix_cache_hits_total`), since vLLM's docs and
        users name them both ways. Histograms give `_sum` and `_count`.
        """
        values: dict[str, float] = {}
        for family in self.registry.collect():
            for sample in family.samples:
                if sample.name.endswith(_SKIPPED_SUFFIXES):
                    continue
                key = sample.name + _format_labels(sample.labels)
                values[key] = float(sample.value)
                if family.type == "counter" and sample.name == family.name + "_total":
                    values[family.name + _format_labels(sample.labels)] = float(sample.value)
        return values

    def render(self, labels: Mapping[str, str] | None = None) -> bytes:
        """Prometheus text exposition (the body of GET /metrics); `labels` are added to every
        series (the server's model_name and engine, as vLLM labels its series)."""
        return generate_latest(_Labelled(self.registry, labels) if labels else self.registry)


class _Labelled:
    """A registry's families with the same labels added to every sample."""

    def __init__(self, registry: CollectorRegistry, labels: Mapping[str, str]) -> None:
        self._registry = registry
        self._labels = dict(labels)

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            labelled.samples = [sample._replace(labels={**self._labels, **sample.labels})
                                for sample in family.samples]
            yield labelled


def _format_labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{key}="{value}"' for key, value in labels.items())
    return "{" + inner + "}"
