"""What the engine hands back per request, in vLLM's offline-API shape."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvtier.logprobs import PromptLogprobs, SampleLogprobs


@dataclass
class CompletionOutput:
    """One of the request's n completions; text and token ids are cumulative."""

    index: int
    text: str
    token_ids: list[int]
    # "stop" | "length" | "abort" | "error" once finished, else None.
    finish_reason: str | None = None
    # The stop string or stop token id that ended it, if one did.
    stop_reason: int | str | None = None
    # Per generated token, when SamplingParams.logprobs was set.
    logprobs: SampleLogprobs | None = None
    # The sum of the generated tokens' logprobs, when SamplingParams.logprobs was set.
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        """A method, as in vLLM (RequestOutput.finished is a field)."""
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    # Per prompt token (None for the first), when SamplingParams.prompt_logprobs was set; from
    # the first output with a generated token on.
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    # Prompt tokens served from the prefix cache (local hit or connector load).
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    error: str | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))
