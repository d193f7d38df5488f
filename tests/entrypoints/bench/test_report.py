"""Summary statistics of hand-made results: exact percentiles, per-turn rows, throughput."""

from kvtier.entrypoints.bench.client import RequestResult
from kvtier.entrypoints.bench.config import MultiTurnConfig, ServerTarget
from kvtier.entrypoints.bench.metrics_scrape import TierHits
from kvtier.entrypoints.bench.report import REPORT_FIELDS, distribution, summarize
from kvtier.entrypoints.bench.workload import ConversationId


def _result(turn, ttft, latency, out_tokens, prompt_tokens=100, error=None):
    return RequestResult(conversation_id=ConversationId(0), turn=turn, start_s=0.0, ttft_s=ttft,
                         latency_s=latency, output_text="", num_prompt_tokens=prompt_tokens,
                         num_output_tokens=out_tokens, error=error)


def test_distribution_interpolates_percentiles():
    stats = distribution([1.0, 2.0, 3.0, 4.0, 5.0])
    assert stats == {"mean": 3.0, "p50": 3.0, "p90": 4.6, "p99": 4.96}


def test_distribution_of_nothing_is_none():
    assert distribution([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_tpot_excludes_the_first_token():
    assert _result(0, ttft=0.5, latency=1.5, out_tokens=11).tpot_s == 0.1
    assert _result(0, ttft=0.5, latency=0.5, out_tokens=1).tpot_s is None


def test_summary_counts_failures_and_throughput():
    results = [_result(0, 0.2, 1.2, 11), _result(1, 0.4, 1.4, 11),
               _result(1, None, 0.1, 0, error="HTTP 500: boom")]
    config = MultiTurnConfig(num_turns=2)
    report = summarize(results, duration_s=2.0, config=config, url=ServerTarget().base_url,
                       api="chat", model="m", hit_rates={"device": TierHits(3.0, 4.0)},
                       label="run")
    assert tuple(report) == REPORT_FIELDS
    assert (report["num_requests"], report["num_failed"]) == (3, 1)
    assert report["input_tokens"] == 200 and report["output_tokens"] == 22
    assert report["input_tokens_per_s"] == 100.0
    assert report["output_tokens_per_s"] == 11.0
    assert report["requests_per_s"] == 1.0
    assert report["ttft_s"]["p50"] == 0.30000000000000004
    assert [(row["turn"], row["count"], row["p50"]) for row in report["ttft_by_turn_s"]] == \
        [(0, 1, 0.2), (1, 1, 0.4)]
    assert report["hit_rates"] == {"device": {"hits": 3.0, "queries": 4.0, "hit_rate": 0.75}}
    assert report["errors"] == ["HTTP 500: boom"]
