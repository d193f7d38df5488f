"""API sampling fields into SamplingParams."""

from __future__ import annotations

import json

import pytest

from kvtier.entrypoints.openai.errors import BadRequestError
from kvtier.entrypoints.openai.protocol import CompletionRequest
from kvtier.entrypoints.openai.sampling import (
    completion_sampling_params,
    load_sampling_defaults,
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


def write_config(directory, **values) -> str:
    (directory / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, **values}))
    return str(directory)


def test_auto_reads_the_models_generation_config_for_unset_fields_only(tmp_path):
    model = write_config(tmp_path, temperature=0.6, top_p=0.9, top_k=20, max_new_tokens=64)
    defaults = load_sampling_defaults("auto", model)
    assert defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    params = completion_sampling_params(request(top_p=0.5), 1, defaults)
    assert (params.temperature, params.top_p, params.top_k, params.min_p,
            params.repetition_penalty) == (0.6, 0.5, 20, 0.0, 1.0)


def test_no_generation_config_means_the_usual_defaults(tmp_path):
    assert load_sampling_defaults("auto", str(tmp_path)) == {}
    assert load_sampling_defaults("auto", str(tmp_path / "model.gguf")) == {}
    assert load_sampling_defaults("auto", None) == {}
    assert load_sampling_defaults("vllm", write_config(tmp_path, temperature=0.1)) == {}
    params = completion_sampling_params(request(), 1, {})
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 1.0, 0)


def test_a_given_directory_is_read_and_must_hold_one(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert load_sampling_defaults(write_config(elsewhere, min_p=0.05), None) == {"min_p": 0.05}
    with pytest.raises(ValueError, match="no generation_config.json there"):
        load_sampling_defaults(str(tmp_path / "missing"), None)


@pytest.mark.parametrize("values, message", [
    ({"temperature": "hot"}, "temperature must be a number, got 'hot'"),
    ({"top_p": 0.0}, "SamplingParams.top_p must be in (0, 1]"),
])
def test_a_bad_generation_config_fails_at_start_naming_the_file(tmp_path, values, message):
    with pytest.raises(ValueError) as info:
        load_sampling_defaults("auto", write_config(tmp_path, **values))
    assert str(tmp_path / "generation_config.json") in str(info.value)
    assert message in str(info.value)
