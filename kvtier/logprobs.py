"""Logprobs in vLLM's shape: per token, {token_id: Logprob} holding the top-k tokens of the
model's distribution plus the token actually there (sampled, or the prompt's own)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    logprob: float
    # 1 for the most likely token of the distribution.
    rank: int | None = None
    # The token's text on its own; None where the engine has no tokenizer.
    decoded_token: str | None = None


# One entry per generated token.
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token; the first is None (nothing precedes it to predict it).
PromptLogprobs = list[dict[int, Logprob] | None]
