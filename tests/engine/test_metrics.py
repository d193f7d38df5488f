from prometheus_client.parser import text_string_to_metric_families

from kvtier.engine.metrics import MetricsRegistry


def test_snapshot_names_counters_both_ways_and_labels_series():
    metrics = MetricsRegistry()
    metrics.counter("vllm:prefix_cache_hits", "hits").inc(3)
    metrics.gauge("vllm:num_requests_running", "running").set(2)
    success = metrics.counter("vllm:request_success", "done", labelnames=("finished_reason",))
    success.labels(finished_reason="stop").inc()
    metrics.histogram("vllm:e2e_request_latency_seconds", "latency", buckets=(1.0,)).observe(0.5)
    snap = metrics.snapshot()
    assert snap["vllm:prefix_cache_hits"] == 3.0
    assert snap["vllm:prefix_cache_hits_total"] == 3.0
    assert snap["vllm:num_requests_running"] == 2.0
    assert snap['vllm:request_success{finished_reason="stop"}'] == 1.0
    assert snap["vllm:e2e_request_latency_seconds_count"] == 1.0
    assert snap["vllm:e2e_request_latency_seconds_sum"] == 0.5
    assert not any(key.endswith(("_created", "_bucket")) for key in snap)


def test_same_name_returns_the_same_collector_and_clashes_are_errors():
    metrics = MetricsRegistry()
    first = metrics.counter("kvtier:x", "x", labelnames=("tier",))
    assert metrics.counter("kvtier:x", "x", labelnames=("tier",)) is first
    try:
        metrics.gauge("kvtier:x", "x")
    except ValueError as exc:
        assert "kvtier:x" in str(exc)
    else:
        raise AssertionError("a gauge under a counter's name must be refused")


def test_registries_are_independent_and_render_parses():
    one, two = MetricsRegistry(), MetricsRegistry()
    one.counter("vllm:generation_tokens", "tokens").inc(5)
    two.counter("vllm:generation_tokens", "tokens").inc(1)
    families = {f.name: f for f in text_string_to_metric_families(one.render().decode())}
    assert families["vllm:generation_tokens"].samples[0].value == 5.0
    assert two.snapshot()["vllm:generation_tokens"] == 1.0
