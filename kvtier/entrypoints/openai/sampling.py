"""Turns an API request into SamplingParams, refusing what the engine cannot honour.

SamplingParams owns the value rules (ranges, min_tokens <= max_tokens); this file adds the
limits that protect a shared server (n, logprobs, seed range) and the OpenAI fields kvtier does
not implement, so nothing is silently ignored. Each refusal names the request field.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from kvtier.common.token_ids import first_outside
from kvtier.entrypoints.openai.errors import BadRequestError
from kvtier.entrypoints.openai.protocol import (
    APIRequest,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from kvtier.entrypoints.openai.structured import structured_outputs
from kvtier.sampling_params import SamplingParams, StructuredOutputsParams

# Completions one request may ask for (prompts x n): each one is a request in the engine.
MAX_CHOICES = 128
# The most top logprobs per token, as OpenAI allows.
MAX_LOGPROBS = 20
_SEED_RANGE = (-(2 ** 63), 2 ** 64 - 1)
_FIELD_IN_MESSAGE = re.compile(r"SamplingParams\.(\w+)")
# Sampling fields a request may leave unset (the generation config's, see
# kvtier/models/generation_config.py), and what they are without one.
_FALLBACKS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
              "repetition_penalty": 1.0}
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty")
# logit_bias values are clamped to +-this.
MAX_LOGIT_BIAS = 100.0
# Every engine step looks for each stop string in a request's new text and tries each bad
# word against its last tokens, in Python, before any request of the batch gets its token:
# one request with 200k of them slowed every other 20-50x. These bounds (OpenAI allows 4 stop
# strings, vLLM any number) leave room for any real use at a few microseconds a step.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 4096
MAX_BAD_WORDS = 128
MAX_BAD_WORDS_CHARS = 4096
# Fields of OpenAI's API or of vLLM's that would change the answer and that kvtier does not
# implement: refused when set to anything but their "off" value (other unknown fields are
# ignored). Each name maps to the values that mean off besides null, false, [] and {}.
# (chat's echo starts the answer with the last message's text.)
_UNSUPPORTED = {name: () for name in ("use_beam_search", "logits_processors")}
_UNSUPPORTED_IN_CHAT = {**_UNSUPPORTED, "echo": (), "functions": (), "function_call": ("none",),
                        "audio": (), "modalities": (["text"],),
                        "documents": (), "chat_template": ()}


def completion_sampling_params(request: CompletionRequest, num_prompts: int,
                               defaults: Mapping[str, float] | None = None) -> SamplingParams:
    _check_common(request, num_prompts)
    refuse_unsupported(request, _UNSUPPORTED)
    if request.best_of is not None and request.best_of != request.n:
        raise BadRequestError("best_of other than n is not supported", param="best_of",
                              code="unsupported_parameter")
    if request.suffix is not None:
        raise BadRequestError("suffix is not supported", param="suffix",
                              code="unsupported_parameter")
    _check_logprobs(request.logprobs, "logprobs")
    max_tokens = request.max_tokens
    if max_tokens == 0:
        if not request.echo:
            raise BadRequestError("max_tokens must be >= 1, or 0 with echo set to true (the "
                                  "prompt alone is answered)", param="max_tokens",
                                  code="invalid_value")
        max_tokens = 1  # the prompt alone is answered; the engine computes one token past it
    # An echoed prompt's tokens get logprobs like the generated ones, as vLLM gives them.
    prompt_logprobs = request.prompt_logprobs
    if prompt_logprobs is None and request.echo:
        prompt_logprobs = request.logprobs
    return _build(request, max_tokens=max_tokens, max_tokens_param="max_tokens",
                  logprobs=request.logprobs, prompt_logprobs=prompt_logprobs,
                  defaults=defaults)


def chat_sampling_params(request: ChatCompletionRequest,
                         defaults: Mapping[str, float] | None = None,
                         tool_constraint: StructuredOutputsParams | None = None
                         ) -> SamplingParams:
    """`tool_constraint`: the structured output a tool_choice asks for (tools.py)."""
    _check_common(request, 1)
    refuse_unsupported(request, _UNSUPPORTED_IN_CHAT)
    if request.top_logprobs is not None and not request.logprobs:
        raise BadRequestError("top_logprobs needs logprobs set to true", param="top_logprobs",
                              code="invalid_value")
    _check_logprobs(request.top_logprobs, "top_logprobs")
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    max_tokens = request.max_completion_tokens if param == "max_completion_tokens" \
        else request.max_tokens
    return _build(request, max_tokens=max_tokens, max_tokens_param=param, logprobs=logprobs,
                  prompt_logprobs=request.prompt_logprobs, defaults=defaults,
                  tool_constraint=tool_constraint)


def check_token_ids(request: SamplingFields, vocab_size: int) -> None:
    """Token ids a request carries beside its prompt must be in the vocabulary: one past it
    would fail the sampling step of every request batched with it."""
    for param, ids in (("stop_token_ids", request.stop_token_ids or ()),
                       ("logit_bias", logit_bias(request) or ()),
                       ("allowed_token_ids", request.allowed_token_ids or ())):
        bad = first_outside(list(ids), vocab_size)
        if bad is not None:
            raise BadRequestError(f"{param} holds token id {bad}, outside the vocabulary "
                                  f"[0, {vocab_size})", param=param, code="invalid_value")


def logit_bias(request: SamplingFields) -> dict[int, float] | None:
    """OpenAI's logit_bias (token id strings -> bias) with int keys and each bias clamped to
    [-100, 100], as OpenAI documents it."""
    if not request.logit_bias:
        return None
    bias = {}
    for key, value in request.logit_bias.items():
        try:
            token = int(key)
        except ValueError:
            raise BadRequestError(f"logit_bias keys must be token ids, got {key!r}",
                                  param="logit_bias", code="invalid_value") from None
        if not math.isfinite(value):
            raise BadRequestError(f"logit_bias[{key!r}] must be a finite number, got {value}",
                                  param="logit_bias", code="invalid_value")
        bias[token] = min(max(value, -MAX_LOGIT_BIAS), MAX_LOGIT_BIAS)
    return bias


def refuse_unsupported(request: APIRequest, fields: Mapping[str, tuple]) -> None:
    """400 for an extra field of `fields` set to anything but its "off" values (or null,
    false, [] and {})."""
    for name, value in (request.model_extra or {}).items():
        if name not in fields:
            continue
        # `is False`: 0 == False, and a 0 may ask for something.
        if not (value is False or value == [] or value == {} or value in fields[name]):
            raise BadRequestError(f"{name} is not supported; leave it unset", param=name,
                                  code="unsupported_parameter")


def _check_common(request: SamplingFields, num_prompts: int) -> None:
    for name in _FLOAT_FIELDS:
        value = getattr(request, name)
        if value is not None and not math.isfinite(value):
            raise BadRequestError(f"{name} must be a finite number, got {value}", param=name,
                                  code="invalid_value")
    if request.n * num_prompts > MAX_CHOICES:
        raise BadRequestError(f"n x number of prompts must be <= {MAX_CHOICES}, got "
                              f"{request.n * num_prompts}", param="n", code="invalid_value")
    if request.seed is not None and not _SEED_RANGE[0] <= request.seed <= _SEED_RANGE[1]:
        raise BadRequestError("seed must fit in 64 bits", param="seed", code="invalid_value")
    if request.stream_options is not None and not request.stream:
        raise BadRequestError("stream_options needs stream set to true",
                              param="stream_options", code="invalid_value")
    stop = [request.stop] if isinstance(request.stop, str) else request.stop or []
    _check_strings(stop, "stop", "stop strings", MAX_STOP_STRINGS, MAX_STOP_CHARS)
    _check_strings(request.bad_words or [], "bad_words", "bad words", MAX_BAD_WORDS,
                   MAX_BAD_WORDS_CHARS)


def _check_strings(values: list[str], param: str, what: str, max_count: int,
                   max_chars: int) -> None:
    if len(values) > max_count:
        raise BadRequestError(f"{param} holds {len(values)} {what}; send at most {max_count}",
                              param=param, code="invalid_value")
    num_chars = sum(map(len, values))
    if num_chars > max_chars:
        raise BadRequestError(f"{param} holds {num_chars} characters in all; send at most "
                              f"{max_chars}", param=param, code="invalid_value")


def _check_logprobs(value: int | None, param: str) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise BadRequestError(f"{param} must be in [0, {MAX_LOGPROBS}], got {value}",
                              param=param, code="invalid_value")


def _build(request: SamplingFields, *, max_tokens: int | None, max_tokens_param: str,
           logprobs: int | None, prompt_logprobs: int | None,
           defaults: Mapping[str, float] | None,
           tool_constraint: StructuredOutputsParams | None = None) -> SamplingParams:
    _check_logprobs(request.prompt_logprobs, "prompt_logprobs")
    if max_tokens is not None and max_tokens < 1:
        raise BadRequestError(f"{max_tokens_param} must be >= 1, got {max_tokens}",
                              param=max_tokens_param, code="invalid_value")
    constraint = structured_outputs(request)
    if constraint is not None and tool_constraint is not None:
        raise BadRequestError("tool_choice \"required\" or a named function already holds the "
                              "output to the calls' JSON; leave response_format and "
                              "structured_outputs unset", param="tool_choice",
                              code="invalid_value")
    defaults = defaults or {}
    sampling = {name: defaults.get(name, fallback) if getattr(request, name) is None
                else getattr(request, name) for name, fallback in _FALLBACKS.items()}
    options = dict(
        n=request.n, **sampling,
        presence_penalty=request.presence_penalty, frequency_penalty=request.frequency_penalty,
        logit_bias=logit_bias(request),
        seed=request.seed, max_tokens=max_tokens, min_tokens=request.min_tokens,
        stop=[request.stop] if isinstance(request.stop, str) else list(request.stop or []),
        stop_token_ids=list(request.stop_token_ids or []), ignore_eos=request.ignore_eos,
        include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=request.skip_special_tokens, logprobs=logprobs,
        prompt_logprobs=prompt_logprobs, allowed_token_ids=_unique(request.allowed_token_ids),
        bad_words=list(request.bad_words or []),
        structured_outputs=constraint or tool_constraint)
    try:
        return SamplingParams(**options)
    except ValueError as exc:
        match = _FIELD_IN_MESSAGE.search(str(exc))
        param = match.group(1) if match else None
        if param == "max_tokens":
            param = max_tokens_param
        raise BadRequestError(str(exc), param=param, code="invalid_value") from exc


def _unique(token_ids: list[int] | None) -> list[int] | None:
    """Each id once, in order: the sampler turns the list into a tensor, and repeats (600k of
    them) only made that slow; checked against the vocabulary, it is at most its size."""
    return None if token_ids is None else list(dict.fromkeys(token_ids))
