"""`speculative_config`: vLLM's shape, e.g. {"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_max": 4, "prompt_lookup_min": 2}."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram",)
# Drafts longer than this are refused: each costs a token of compute whether or not it is kept.
MAX_SPECULATIVE_TOKENS = 16
# Longer n-grams are refused: each length is one scan of the request's recent tokens per step.
MAX_PROMPT_LOOKUP = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """n-gram speculation ("prompt lookup"): when the last n tokens (n from prompt_lookup_max
    down to prompt_lookup_min) occurred before in the request, the tokens that followed them
    there are the draft, up to num_speculative_tokens of them."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2

    def __post_init__(self) -> None:
        def whole(name: str) -> int | None:
            value = getattr(self, name)
            return value if isinstance(value, int) and not isinstance(value, bool) else None

        checks = [
            (self.method in METHODS, "method", f"must be one of {', '.join(METHODS)}"),
            (whole("num_speculative_tokens") is not None
             and 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
             "num_speculative_tokens", f"must be an integer in [1, {MAX_SPECULATIVE_TOKENS}]"),
            (whole("prompt_lookup_min") is not None and self.prompt_lookup_min >= 1,
             "prompt_lookup_min", "must be an integer >= 1"),
            (whole("prompt_lookup_max") is not None and whole("prompt_lookup_min") is not None
             and self.prompt_lookup_min <= self.prompt_lookup_max <= MAX_PROMPT_LOOKUP,
             "prompt_lookup_max", f"must be an integer in [prompt_lookup_min, "
             f"{MAX_PROMPT_LOOKUP}]"),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise ValueError(f"speculative_config.{name} {rule}, got "
                                 f"{getattr(self, name)!r}")

    @classmethod
    def parse(cls, value: Any, where: str) -> SpeculativeConfig | None:
        """From itself, a dict or JSON text (the CLI form); None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where} is not valid JSON ({exc}); write it like "
                                 '{"method": "ngram", "num_speculative_tokens": 4}') from None
        if not isinstance(value, dict):
            raise ValueError(f"{where} must be a JSON object, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown}; valid keys are {sorted(known)}")
        return cls(**value)
