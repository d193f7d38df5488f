"""A model's generation_config.json as sampling defaults: for the server's requests that leave
the fields unset, and for LLM.generate without sampling parameters."""

from __future__ import annotations

import json

import pytest

from kvtier import LLM, SamplingParams
from kvtier.entrypoints.openai.protocol import CompletionRequest
from kvtier.entrypoints.openai.sampling import completion_sampling_params
from kvtier.models import ModelLoadError
from kvtier.models.generation_config import load_eos_token_ids, load_sampling_defaults

from ..tiny_models import make_hf_model


def request(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "x", **fields})


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


def test_llm_generate_without_parameters_samples_with_the_models_defaults(tmp_path):
    make_hf_model("llama", tmp_path)
    write_config(tmp_path, temperature=0.0, repetition_penalty=1.3)
    llm = LLM(str(tmp_path), dtype="float32", block_size=4, num_device_blocks=32)
    try:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.repetition_penalty, defaults.max_tokens) == (
            0.0, 1.3, 16)
        prompt = {"prompt_token_ids": [5, 6, 7, 8]}
        assert llm.generate(prompt)[0].outputs[0].token_ids == llm.generate(
            prompt, defaults)[0].outputs[0].token_ids
    finally:
        llm.engine.shutdown()


def test_its_eos_token_ids_end_completions_too(tmp_path):
    """Chat models often list their end-of-turn token in generation_config.json only."""
    make_hf_model("llama", tmp_path)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    llm = LLM(str(tmp_path), dtype="float32", block_size=4, num_device_blocks=32)
    tokens = llm.generate(prompt, greedy)[0].outputs[0].token_ids
    llm.shutdown()
    stop = tokens[2]
    write_config(tmp_path, eos_token_id=[2, stop])
    llm = LLM(str(tmp_path), dtype="float32", block_size=4, num_device_blocks=32)
    out = llm.generate(prompt, greedy)[0].outputs[0]
    assert out.token_ids == tokens[:tokens.index(stop) + 1] and out.finish_reason == "stop"
    ignoring = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert llm.generate(prompt, ignoring)[0].outputs[0].token_ids == tokens
    llm.shutdown()
    write_config(tmp_path, eos_token_id=[2, "x"])
    with pytest.raises(ValueError, match="eos_token_id must be a token id or a list"):
        LLM(str(tmp_path), dtype="float32", block_size=4, num_device_blocks=32)


@pytest.mark.parametrize("value", ["</s>", [2, "<|im_end|>"], 2.0, True, [2, None], -1])
def test_eos_token_ids_of_the_wrong_type_are_refused_naming_the_file(tmp_path, value):
    write_config(tmp_path, eos_token_id=value)
    with pytest.raises(ModelLoadError) as info:
        load_eos_token_ids(str(tmp_path))
    assert info.value.path == str(tmp_path / "generation_config.json")
    assert info.value.problem == (f"eos_token_id must be a token id or a list of them "
                                  f"(integers >= 0), got {value!r}; write the ids the "
                                  "tokenizer gives the tokens, not their text")


def test_eos_token_ids_read_one_id_or_a_list(tmp_path):
    assert load_eos_token_ids(write_config(tmp_path, eos_token_id=[2, 5])) == (2, 5)
    assert load_eos_token_ids(write_config(tmp_path, eos_token_id=7)) == (7,)
    assert load_eos_token_ids(str(tmp_path / "model.gguf")) == ()
