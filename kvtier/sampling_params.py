"""Per-request sampling and stopping parameters, in vLLM's and OpenAI's shape."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Real

# The fields' types, checked before their ranges: a float max_tokens or a string flag would
# otherwise pass the range checks and misbehave later (inside a batched step).
_INTS = ("n", "top_k", "min_tokens")
_OPTIONAL_INTS = ("seed", "max_tokens", "logprobs", "prompt_logprobs")
_REALS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
          "repetition_penalty")
_BOOLS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens")
# torch's generators take seeds in [-2**63, 2**64); completion i of n uses seed + i.
SEED_RANGE = (-(2 ** 63), 2 ** 64)
GREEDY_BELOW = 1e-5


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# StructuredOutputsParams' constraints, of which a request gives exactly one.
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """vLLM's structured outputs: the generated text must match one constraint.

    json: a JSON schema (a dict or its JSON text); regex: a regular expression; choice: one of
    these strings exactly; grammar: a context-free grammar (Lark or GBNF); json_object: any JSON
    object. The JSON options: no whitespace between tokens (`disable_any_whitespace`), or only
    what `whitespace_pattern` matches; objects without additionalProperties get none
    (`disable_additional_properties`). Compiled by kvtier/structured_output/.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        given = [kind for kind in STRUCTURED_OUTPUT_KINDS if getattr(self, kind) is not None]
        if len(given) != 1:
            raise ValueError("SamplingParams.structured_outputs must give exactly one of "
                             f"{', '.join(STRUCTURED_OUTPUT_KINDS)}; got "
                             f"{', '.join(given) or 'none'}")
        checks = [("json", "a JSON schema (an object or its JSON text)",
                   isinstance(self.json, (str, dict))),
                  ("regex", "a string", isinstance(self.regex, str)),
                  ("choice", "a non-empty list of strings", isinstance(self.choice, list)
                   and bool(self.choice) and all(isinstance(c, str) for c in self.choice)),
                  ("grammar", "a non-empty string", isinstance(self.grammar, str)
                   and bool(self.grammar.strip())),
                  ("json_object", "true", self.json_object is True)]
        for kind, rule, ok in checks:
            if kind in given and not ok:
                raise ValueError(f"SamplingParams.structured_outputs.{kind} must be {rule}, "
                                 f"got {getattr(self, kind)!r}")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SamplingParams.structured_outputs.{name} must be true or "
                                 f"false, got {getattr(self, name)!r}")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise ValueError("SamplingParams.structured_outputs.whitespace_pattern must be a "
                             f"regular expression string, got {self.whitespace_pattern!r}")

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) is not None)


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    Validated once on construction; a bad value raises ValueError naming the field.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    min_p: float = 0.0
    # OpenAI's penalties, on the tokens generated so far: each logit less frequency_penalty
    # times its token's count and presence_penalty if it occurs at all.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's (and HF's) on the prompt's and generated tokens: a positive logit divided by it, a
    # negative one multiplied (1: none).
    repetition_penalty: float = 1.0
    # Token id -> added to its logit before sampling (greedy too).
    logit_bias: dict[int, float] | None = None
    # Only these token ids may be generated (greedy too); None: any.
    allowed_token_ids: list[int] | None = None
    # Words never generated, as vLLM bans them: each word's tokens (with and without a leading
    # space) are never completed by the generated tokens.
    bad_words: list[str] = field(default_factory=list)
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Per generated token, the logprobs of the top `logprobs` tokens and the sampled one; per
    # prompt token, of the top `prompt_logprobs` and the prompt's own (the whole prompt is then
    # computed: no cached prefix is read). -1: the whole vocabulary.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # The output must match this constraint (a dict is taken as its fields).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = _structured_outputs(self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # None: no stops, as vLLM takes it; a tuple is taken as a list.
        if self.stop is None or isinstance(self.stop, tuple):
            self.stop = list(self.stop or ())
        if self.stop_token_ids is None or isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids or ())
        if isinstance(self.allowed_token_ids, tuple):
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words is None or isinstance(self.bad_words, tuple):
            self.bad_words = list(self.bad_words or ())
        self._check_types()
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _check_types(self) -> None:
        checks = [(name, "an int", _is_int(getattr(self, name))) for name in _INTS]
        checks += [(name, "an int or None", getattr(self, name) is None
                    or _is_int(getattr(self, name))) for name in _OPTIONAL_INTS]
        # Finite: an infinite temperature samples uniform noise, and NaN passes every range
        # check below (each comparison is false).
        checks += [(name, "a finite number", isinstance(getattr(self, name), Real)
                    and not isinstance(getattr(self, name), bool)
                    and math.isfinite(getattr(self, name))) for name in _REALS]
        checks += [(name, "true or false", isinstance(getattr(self, name), bool))
                   for name in _BOOLS]
        checks += [("stop", "a string or a list of strings", isinstance(self.stop, list)
                    and all(isinstance(s, str) for s in self.stop)),
                   ("stop_token_ids", "a list of token ids", isinstance(self.stop_token_ids,
                                                                         list)),
                   ("bad_words", "a list of strings", isinstance(self.bad_words, list)
                    and all(isinstance(w, str) for w in self.bad_words)),
                   ("structured_outputs", "StructuredOutputsParams or None",
                    self.structured_outputs is None
                    or isinstance(self.structured_outputs, StructuredOutputsParams))]
        for name, kind, ok in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name} must be {kind}, got "
                                 f"{getattr(self, name)!r}")

    def _validate(self) -> None:
        checks = [
            (self.n >= 1, "n", "must be >= 1"),
            (self.temperature >= 0.0, "temperature", "must be >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (self.top_k >= 0, "top_k", "must be >= 0 (or -1 to disable)"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
            (0.0 < self.repetition_penalty < math.inf, "repetition_penalty",
             "must be > 0 and finite"),
            (self.logit_bias is None or all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0
                and isinstance(b, (int, float)) and math.isfinite(b)
                for t, b in self.logit_bias.items()), "logit_bias",
             "must map token ids (ints >= 0) to finite numbers"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be >= 1"),
            (self.min_tokens >= 0, "min_tokens", "must be >= 0"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             "must be <= max_tokens"),
            (self.logprobs is None or self.logprobs >= -1, "logprobs",
             "must be >= 0 (or -1 for the whole vocabulary)"),
            (self.prompt_logprobs is None or self.prompt_logprobs >= -1, "prompt_logprobs",
             "must be >= 0 (or -1 for the whole vocabulary)"),
            (all(s for s in self.stop), "stop", "must not contain empty strings"),
            (self.seed is None or SEED_RANGE[0] <= self.seed
             and self.seed + self.n - 1 < SEED_RANGE[1], "seed",
             "must be in [-2**63, 2**64 - n] (completion i of n draws with seed + i)"),
            (all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                 for t in self.stop_token_ids), "stop_token_ids",
             "must hold token ids (ints >= 0)"),
            (self.allowed_token_ids is None or isinstance(self.allowed_token_ids, list)
             and self.allowed_token_ids and all(
                 isinstance(t, int) and not isinstance(t, bool) and t >= 0
                 for t in self.allowed_token_ids), "allowed_token_ids",
             "must be None or a non-empty list of token ids (ints >= 0)"),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name} {rule}, got {getattr(self, name)!r}")

    @property
    def is_greedy(self) -> bool:
        # As vLLM: a temperature this small is greedy (dividing by it overflows the logits).
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


def _structured_outputs(fields: dict) -> StructuredOutputsParams:
    known = StructuredOutputsParams.__dataclass_fields__
    unknown = sorted(str(k) for k in fields if k not in known)
    if unknown:
        raise ValueError(f"SamplingParams.structured_outputs has unknown fields {unknown}; "
                         f"the fields are {', '.join(known)}")
    return StructuredOutputsParams(**fields)
