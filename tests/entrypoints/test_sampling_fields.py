"""API sampling fields into SamplingParams."""

from __future__ import annotations

import pytest

from kvtier.entrypoints.openai.errors import BadRequestError
from kvtier.entrypoints.openai.protocol import CompletionRequest
from kvtier.entrypoints.openai.sampling import (
    MAX_BAD_WORDS,
    MAX_BAD_WORDS_CHARS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    completion_sampling_params,
    logit_bias,
)


def request(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "x", **fields})


def test_logit_bias_keys_become_token_ids_and_values_clamp_to_100():
    assert logit_bias(request(logit_bias={"5": -1000, "6": 3, "7": 250.5})) == {
        5: -100.0, 6: 3.0, 7: 100.0}
    assert logit_bias(request()) is None


def test_penalties_reach_sampling_params():
    params = completion_sampling_params(request(
        presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.2,
        logit_bias={"3": 1.5}), 1)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty,
            params.logit_bias) == (0.5, -1.0, 1.2, {3: 1.5})
    assert completion_sampling_params(request(), 1).repetition_penalty == 1.0


@pytest.mark.parametrize("fields, param", [
    ({"presence_penalty": 2.01}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": -1}, "repetition_penalty"),
    ({"logit_bias": {"1.5": 2}}, "logit_bias"),
])
def test_out_of_range_fields_are_refused_naming_them(fields, param):
    with pytest.raises(BadRequestError) as info:
        completion_sampling_params(request(**fields), 1)
    assert info.value.param == param


@pytest.mark.parametrize("fields, param, message", [
    # Each is looked for, or tried, every engine step: 200k of them slowed every request.
    ({"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}, "stop",
     f"stop holds {MAX_STOP_STRINGS + 1} stop strings; send at most {MAX_STOP_STRINGS}"),
    ({"stop": "x" * (MAX_STOP_CHARS + 1)}, "stop",
     f"stop holds {MAX_STOP_CHARS + 1} characters in all; send at most {MAX_STOP_CHARS}"),
    ({"bad_words": ["w"] * (MAX_BAD_WORDS + 1)}, "bad_words",
     f"bad_words holds {MAX_BAD_WORDS + 1} bad words; send at most {MAX_BAD_WORDS}"),
    ({"bad_words": ["w" * 100] * (MAX_BAD_WORDS_CHARS // 100 + 1)}, "bad_words",
     f"bad_words holds {(MAX_BAD_WORDS_CHARS // 100 + 1) * 100} characters in all; send at "
     f"most {MAX_BAD_WORDS_CHARS}"),
])
def test_long_stop_and_bad_word_lists_are_refused_naming_them(fields, param, message):
    with pytest.raises(BadRequestError) as info:
        completion_sampling_params(request(**fields), 1)
    assert (info.value.param, info.value.message) == (param, message)


def test_lists_at_the_limits_are_taken():
    params = completion_sampling_params(request(
        stop=[f"{i:063d}" for i in range(MAX_STOP_STRINGS)],
        bad_words=["w" * 32] * MAX_BAD_WORDS), 1)
    assert (len(params.stop), len(params.bad_words)) == (MAX_STOP_STRINGS, MAX_BAD_WORDS)


def test_allowed_token_ids_come_once_each_in_order():
    """The sampler makes a tensor of the list: 600k repeats of a few ids made it slow."""
    params = completion_sampling_params(request(allowed_token_ids=[5, 3, 5, 5, 9, 3]), 1)
    assert params.allowed_token_ids == [5, 3, 9]
