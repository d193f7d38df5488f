"""Scheduler options, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from kvtier.spec_decode import SpeculativeConfig

SchedulingPolicy = Literal["fcfs", "priority"]
KVLoadFailurePolicy = Literal["recompute", "fail"]

POLICIES: tuple[str, ...] = ("fcfs", "priority")
KV_LOAD_FAILURE_POLICIES: tuple[str, ...] = ("recompute", "fail")


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits and the rules for requests whose KV comes from a connector.

    `max_model_len` is the engine's context length (derived from the model at start-up); the
    engine builds this object once it knows it.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    policy: SchedulingPolicy = "fcfs"
    # None: unbounded; else add_request raises SchedulerQueueFullError once this many wait.
    max_waiting_requests: int | None = None
    # An asynchronous KV load not reported finished within this many seconds counts as failed.
    kv_load_timeout_s: float = 60.0
    kv_load_failure_policy: KVLoadFailurePolicy = "recompute"
    # Draft tokens for greedy decodes (kvtier/spec_decode); None: none.
    speculative: SpeculativeConfig | None = None
    # Most distinct LoRA adapters among running requests; None: no adapters.
    max_loras: int | None = None

    def __post_init__(self) -> None:
        checks = [
            (self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1"),
            (self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1"),
            (self.max_model_len >= 1, "max_model_len", "must be >= 1"),
            # Without chunking a prompt is scheduled in one piece, so it must fit one step.
            (self.enable_chunked_prefill or self.max_num_batched_tokens >= self.max_model_len,
             "max_num_batched_tokens",
             f"must be >= max_model_len ({self.max_model_len}) when enable_chunked_prefill is "
             "False; raise it or enable chunked prefill"),
            (self.policy in POLICIES, "policy", f"must be one of {', '.join(POLICIES)}"),
            (self.max_waiting_requests is None or self.max_waiting_requests >= 1,
             "max_waiting_requests", "must be >= 1, or None for no limit"),
            (self.max_loras is None or self.max_loras >= 1, "max_loras",
             "must be >= 1, or None without adapters"),
            (self.kv_load_timeout_s > 0, "kv_load_timeout_s", "must be > 0 seconds"),
            (self.kv_load_failure_policy in KV_LOAD_FAILURE_POLICIES, "kv_load_failure_policy",
             f"must be one of {', '.join(KV_LOAD_FAILURE_POLICIES)}"),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise ValueError(f"SchedulerConfig.{name} {rule}, got {getattr(self, name)!r}")
