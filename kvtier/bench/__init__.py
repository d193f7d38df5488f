"""Benchmark tools: the multi-turn conversation workload (issue 7) and its streaming client."""

from kvtier.bench.config import MultiTurnConfig, ServerTarget
from kvtier.bench.report import REPORT_FIELDS
from kvtier.bench.runner import BenchTimeoutError, run_multi_turn

__all__ = ["MultiTurnConfig", "ServerTarget", "REPORT_FIELDS", "BenchTimeoutError",
           "run_multi_turn"]
