"""Benchmark tools: the multi-turn conversation workload and the request-trace replay, their
streaming client for OpenAI-compatible servers and their in-process engine target."""

from kvtier.entrypoints.bench.config import EngineTarget, MultiTurnConfig, ServerTarget
from kvtier.entrypoints.bench.report import REPORT_FIELDS
from kvtier.entrypoints.bench.runner import BenchTimeoutError, run_multi_turn, run_multi_turn_on

__all__ = ["MultiTurnConfig", "ServerTarget", "EngineTarget", "REPORT_FIELDS",
           "BenchTimeoutError", "run_multi_turn", "run_multi_turn_on"]
