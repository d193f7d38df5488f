"""API sampling fields into SamplingParams."""

from __future__ import annotations

import pytest

from kvtier.entrypoints.openai.errors import BadRequestError
from kvtier.entrypoints.openai.protocol import CompletionRequest
from kvtier.entrypoints.openai.sampling import completion_sampling_params, logit_bias


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
