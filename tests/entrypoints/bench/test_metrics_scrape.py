"""Hit rates from two /metrics scrapes: differences, label sums, tiers, missing metrics."""

import pytest

from kvtier.entrypoints.bench.metrics_scrape import TierHits, parse_samples, tier_hits

BEFORE = """\
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 10.0
vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0
# TYPE kvtier:offload_tier_hits counter
kvtier:offload_tier_hits_total{tier="host"} 1.0
# TYPE kvtier:offload_tier_queries counter
kvtier:offload_tier_queries_total{tier="host"} 2.0
"""

AFTER = """\
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 40.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 20.0
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 200.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 100.0
# TYPE kvtier:offload_tier_hits counter
kvtier:offload_tier_hits_total{tier="host"} 4.0
kvtier:offload_tier_hits_total{tier="disk"} 0.0
# TYPE kvtier:offload_tier_queries counter
kvtier:offload_tier_queries_total{tier="host"} 8.0
kvtier:offload_tier_queries_total{tier="disk"} 0.0
"""


def test_parse_drops_created_and_total_suffix():
    samples = parse_samples(BEFORE)
    assert samples[("vllm:prefix_cache_hits", (("engine", "0"), ("model_name", "m")))] == 10.0
    assert not any(name.endswith("_created") for name, _ in samples)


def test_hit_rates_are_differences_summed_over_engines():
    hits = tier_hits(parse_samples(BEFORE), parse_samples(AFTER))
    assert hits == {"device": TierHits(hits=50.0, queries=200.0),
                    "host": TierHits(hits=3.0, queries=6.0),
                    "disk": TierHits(hits=0.0, queries=0.0)}
    assert hits["device"].hit_rate == 0.25
    assert hits["host"].hit_rate == 0.5
    assert hits["disk"].hit_rate is None


def test_server_without_tier_metrics_reports_no_tiers():
    plain = "# TYPE process_cpu_seconds counter\nprocess_cpu_seconds_total 3.0\n"
    assert tier_hits(parse_samples(plain), parse_samples(plain)) == {}


@pytest.mark.parametrize("hits, queries, rate", [(0.0, 4.0, 0.0), (4.0, 4.0, 1.0)])
def test_hit_rate_bounds(hits, queries, rate):
    assert TierHits(hits, queries).hit_rate == rate


def test_tier_queried_but_never_hit_has_zero_hits():
    # prometheus_client writes a labelled series only once it is incremented.
    after = ("# TYPE kvtier:offload_tier_queries counter\n"
             'kvtier:offload_tier_queries_total{tier="host"} 5.0\n')
    hits = tier_hits(parse_samples(""), parse_samples(after))
    assert hits == {"host": TierHits(hits=0.0, queries=5.0)}
    assert hits["host"].hit_rate == 0.0
