"""Summary statistics of a benchmark run and its JSON form."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.entrypoints.bench.client import RequestResult
from kvtier.entrypoints.bench.config import ApiKind, MultiTurnConfig
from kvtier.entrypoints.bench.metrics_scrape import TierHits

PERCENTILES = (50, 90, 99)

# Every key the report has, whatever the target; tests and the sweep rely on all of them being
# present. "url" is None for an in-process engine target.
REPORT_FIELDS = (
    "label", "url", "model", "api", "workload", "num_requests", "num_failed", "duration_s",
    "ttft_s", "ttft_by_turn_s", "tpot_s", "latency_s", "input_tokens", "output_tokens",
    "input_tokens_per_s", "output_tokens_per_s", "requests_per_s", "hit_rates", "errors",
)


def distribution(values: list[float]) -> dict[str, float | None]:
    """Mean and percentiles (linear interpolation); None throughout for no values."""
    stats: dict[str, float | None] = {"mean": float(np.mean(values)) if values else None}
    for p in PERCENTILES:
        stats[f"p{p}"] = float(np.percentile(values, p)) if values else None
    return stats


def summarize(results: list[RequestResult], duration_s: float, config: MultiTurnConfig,
              url: str | None, api: ApiKind, model: str, hit_rates: dict[str, TierHits],
              label: str) -> dict[str, Any]:
    """The report: latency distributions, throughput and hit rates of one run."""
    done = [r for r in results if r.error is None]
    timing = request_summary(results, duration_s, hit_rates)
    report = {
        "label": label,
        "url": url,
        "model": model,
        "api": api,
        "workload": dataclasses.asdict(config),
        "num_requests": timing.pop("num_requests"),
        "num_failed": timing.pop("num_failed"),
        "duration_s": duration_s,
        "ttft_s": timing.pop("ttft_s"),
        "ttft_by_turn_s": _ttft_by_turn(done, config.num_turns),
        **timing,
    }
    return report


def request_summary(results: list[RequestResult], duration_s: float,
                    hit_rates: dict[str, TierHits]) -> dict[str, Any]:
    """Counts, latency distributions, throughput, hit rates and errors of any workload's run."""
    done = [r for r in results if r.error is None]
    input_tokens = sum(r.num_prompt_tokens or 0 for r in done)
    output_tokens = sum(r.num_output_tokens for r in done)
    return {
        "num_requests": len(results),
        "num_failed": len(results) - len(done),
        "ttft_s": distribution([r.ttft_s for r in done if r.ttft_s is not None]),
        "tpot_s": distribution([r.tpot_s for r in done if r.tpot_s is not None]),
        "latency_s": distribution([r.latency_s for r in done]),
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "input_tokens_per_s": input_tokens / duration_s if duration_s > 0 else 0.0,
        "output_tokens_per_s": output_tokens / duration_s if duration_s > 0 else 0.0,
        "requests_per_s": len(done) / duration_s if duration_s > 0 else 0.0,
        "hit_rates": {tier: {"hits": h.hits, "queries": h.queries, "hit_rate": h.hit_rate}
                      for tier, h in hit_rates.items()},
        "errors": sorted({r.error for r in results if r.error is not None}),
    }


def _ttft_by_turn(done: list[RequestResult], num_turns: int) -> list[dict[str, Any]]:
    rows = []
    for turn in range(num_turns):
        ttfts = [r.ttft_s for r in done if r.turn == turn and r.ttft_s is not None]
        rows.append({"turn": turn, "count": len(ttfts), **distribution(ttfts)})
    return rows


def write_json(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


def emit_report(report: dict[str, Any], output_json: Path | None, output_plot: Path | None,
                write_plot: Callable[[dict[str, Any], Path], None]) -> int:
    """The report to `output_json` (else standard output) and its plot to `output_plot`; the
    command's exit status: 1 if any request failed."""
    if output_json is not None:
        write_json(report, output_json)
    else:
        print(json.dumps(report, indent=2))
    if output_plot is not None:
        write_plot(report, output_plot)
    return 1 if report["num_failed"] else 0
