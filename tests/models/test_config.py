"""config.json parsing: architectures, sliding-window layers and groups, RoPE scaling, errors."""

import json

import pytest
import torch

from kvtier.models import ModelConfig, ModelLoadError, load_model
from kvtier.models.hf_config import parse_hf_config

from .helpers import PagedDriver, hf_logits, make_covering_hf_model

_QWEN2_OLD_STYLE = {
    "architectures": ["Qwen2ForCausalLM"], "vocab_size": 100, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "rope_theta": 50000.0, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 512, "use_sliding_window": True, "sliding_window": 32,
    "max_window_layers": 1, "eos_token_id": [7, 9], "tie_word_embeddings": True,
}


def _write_config(directory, config: dict) -> str:
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def test_qwen2_config_without_layer_types(tmp_path):
    config = parse_hf_config(_write_config(tmp_path, _QWEN2_OLD_STYLE), "qwen-old")
    assert config.architecture == "qwen2"
    assert config.layer_sliding_windows == (None, 32, 32)
    assert config.sliding_window == 32
    assert (config.attention_bias, config.o_proj_bias, config.qk_norm) == (True, False, False)
    assert (config.head_dim, config.rope_theta, config.rope_scaling) == (16, 50000.0, None)
    assert config.eos_token_ids == (7, 9)
    groups = config.kv_cache_groups()
    assert [(g.group_id, g.sliding_window, g.layer_indices) for g in groups] == [
        (0, None, (0,)), (1, 32, (1, 2))]
    assert config.layer_group_ids == (0, 1, 1)
    assert config.layer_names[2] == "model.layers.2.self_attn"


def test_qwen2_without_use_sliding_window_has_one_full_group(tmp_path):
    raw = {**_QWEN2_OLD_STYLE, "use_sliding_window": False}
    config = parse_hf_config(_write_config(tmp_path, raw), "q")
    assert config.layer_sliding_windows == (None, None, None)
    assert config.layer_group_ids == (0, 0, 0)


def test_kv_cache_groups_per_architecture(model_pair):
    _, loaded = model_pair
    expected = {"llama": ([(0, None)], [0, 0]), "qwen2": ([(0, None), (1, 5)], [0, 1]),
                "qwen3": ([(0, None)], [0, 0]), "mistral": ([(0, 6)], [0, 0])}
    groups = [(g.group_id, g.sliding_window) for g in loaded.model.kv_cache_groups()]
    assert (groups, loaded.model.layer_group_ids) == expected[loaded.config.architecture]


def test_old_style_llama3_rope_scaling_is_parsed(tmp_path):
    raw = {**_QWEN2_OLD_STYLE, "architectures": ["LlamaForCausalLM"], "rope_scaling": {
        "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}}
    config = parse_hf_config(_write_config(tmp_path, raw), "l")
    assert config.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192}
    assert config.layer_sliding_windows == (None, None, None)


def test_llama3_rope_scaling_matches_hf(tmp_path):
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
            "high_freq_factor": 2.0, "original_max_position_embeddings": 16}
    hf_model = make_covering_hf_model("llama", tmp_path, rope_parameters=rope)
    loaded = load_model(str(tmp_path), dtype=torch.float32)
    assert loaded.config.rope_scaling["rope_type"] == "llama3"
    prompt = [(7 * i) % 120 + 3 for i in range(24)]
    ours = PagedDriver(loaded.model).step({0: prompt})[0]
    torch.testing.assert_close(ours, hf_logits(hf_model, prompt), atol=1e-4, rtol=0)


def test_missing_config_json_names_the_file(tmp_path):
    with pytest.raises(ModelLoadError, match=r"config\.json: file not found"):
        load_model(str(tmp_path))


def test_unknown_architecture_names_the_file(tmp_path):
    _write_config(tmp_path, {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    with pytest.raises(ModelLoadError, match=r"config\.json: unsupported architecture "
                                             r"\['GPT2LMHeadModel'\]"):
        load_model(str(tmp_path))


def test_config_missing_a_key_names_it(tmp_path):
    raw = {k: v for k, v in _QWEN2_OLD_STYLE.items() if k != "hidden_size"}
    with pytest.raises(ModelLoadError, match=r"config\.json: missing required key 'hidden_size'"):
        parse_hf_config(_write_config(tmp_path, raw), "q")


def test_truncated_safetensors_names_the_file(tmp_path):
    make_covering_hf_model("llama", tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: corrupt or truncated"):
        load_model(str(tmp_path))


def test_directory_without_weights(tmp_path):
    _write_config(tmp_path, _QWEN2_OLD_STYLE)
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weight files"):
        load_model(str(tmp_path))


def test_directory_without_tokenizer_loads_with_none(model_pair):
    _, loaded = model_pair
    assert loaded.tokenizer is None
    assert (loaded.config.bos_token_id, loaded.config.eos_token_ids) == (1, (2,))


def test_model_config_validation_names_the_field():
    with pytest.raises(ValueError, match="num_heads \\(6\\) must be a multiple of num_kv_heads"):
        ModelConfig(architecture="llama", vocab_size=10, hidden_size=12, intermediate_size=8,
                    num_layers=1, num_heads=6, num_kv_heads=4, head_dim=2, rope_theta=1e4,
                    rope_scaling=None, rms_norm_eps=1e-6, max_position_embeddings=8,
                    sliding_window=None, layer_sliding_windows=(None,),
                    tie_word_embeddings=False, attention_bias=False, o_proj_bias=False,
                    qk_norm=False, bos_token_id=None, eos_token_ids=(), name="x")


def test_missing_model_path_is_named(tmp_path):
    missing = str(tmp_path / "nowhere")
    with pytest.raises(ModelLoadError, match=r"nowhere: no such model directory or \.gguf file$"):
        load_model(missing)


def test_a_file_that_is_neither_dir_nor_gguf_is_named(tmp_path):
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"\0" * 8)
    with pytest.raises(ModelLoadError, match=r"model\.bin: expected an HF model directory"):
        load_model(str(weights))


@pytest.mark.parametrize("extra, message", [
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     r"rope_scaling \(llama3\) needs a positive number 'low_freq_factor', got None"),
    ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}},
     r"quantization_config \(quant_method 'gptq'\): quantized checkpoints are not supported; "
     r"use an unquantised checkpoint or a GGUF file"),
])
def test_a_config_the_decoder_cannot_honour_is_refused_naming_the_key(tmp_path, extra,
                                                                       message):
    """Each loaded before: a KeyError traceback, SiLU run in place of the activation asked
    for, or "unexpected tensor '...qweight'"."""
    with pytest.raises(ModelLoadError, match=r"config\.json: (invalid value: )?" + message):
        parse_hf_config(_write_config(tmp_path, {**_QWEN2_OLD_STYLE, **extra}), "q")


def test_a_hub_id_is_told_that_kvtier_never_downloads(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelLoadError, match=r"Qwen/Qwen2\.5-0\.5B-Instruct: no such model "
                                             r"directory or \.gguf file; kvtier never downloads "
                                             r"models: .*huggingface-cli download "
                                             r"Qwen/Qwen2\.5-0\.5B-Instruct --local-dir DIR"):
        load_model("Qwen/Qwen2.5-0.5B-Instruct")


_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("extra", [
    {"partial_rotary_factor": 0.5},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                         "partial_rotary_factor": 0.25}},
    {"rope_scaling": {**_LLAMA3_ROPE, "partial_rotary_factor": 0.5}},
])
def test_partial_rotary_factor_below_one_is_refused(tmp_path, extra):
    """Before, it loaded and rotated every dimension of each head."""
    raw = {**_QWEN2_OLD_STYLE, "architectures": ["LlamaForCausalLM"], **extra}
    with pytest.raises(ModelLoadError, match=r"config\.json: partial_rotary_factor 0\.(5|25) is "
                                             r"not supported: kvtier applies RoPE to every "
                                             r"dimension of each head; if the checkpoint was "
                                             r"trained with full RoPE, delete the key"):
        parse_hf_config(_write_config(tmp_path, raw), "l")


@pytest.mark.parametrize("extra, message", [
    ({"eos_token_id": "</s>"}, r"eos_token_id: '</s>' is not a token id"),
    ({"eos_token_id": [7, "<|im_end|>"]}, r"eos_token_id: '<\|im_end\|>' is not a token id"),
    ({"eos_token_id": [7, None]}, r"eos_token_id: None is not a token id"),
    ({"eos_token_id": 7.5}, r"eos_token_id: 7\.5 is not a token id"),
    ({"eos_token_id": True}, r"eos_token_id: True is not a token id"),
    ({"bos_token_id": "<s>"}, r"bos_token_id: '<s>' is not a token id"),
    ({"attention_bias": "false"}, r"attention_bias must be true or false, got 'false'"),
    ({"mlp_bias": 1}, r"mlp_bias must be true or false, got 1"),
])
def test_special_ids_and_flags_of_the_wrong_type_are_refused(tmp_path, extra, message):
    """Before, a list's strings and None became "eos ids" that never match a token, a float
    was truncated, and the string "false" read as true."""
    raw = {**_QWEN2_OLD_STYLE, "architectures": ["LlamaForCausalLM"], **extra}
    with pytest.raises(ModelLoadError, match=r"config\.json: " + message):
        parse_hf_config(_write_config(tmp_path, raw), "l")


def test_harmless_and_unknown_keys_still_load(tmp_path):
    raw = {**_QWEN2_OLD_STYLE, "architectures": ["LlamaForCausalLM"], "partial_rotary_factor": 1.0,
           "rope_scaling": {**_LLAMA3_ROPE, "partial_rotary_factor": 1.0}, "attention_bias": None,
           "mlp_bias": False, "attention_dropout": 0.0, "pretraining_tp": 1,
           "some_future_key": {"x": 1}, "bos_token_id": 1, "eos_token_id": [7, 9]}
    config = parse_hf_config(_write_config(tmp_path, raw), "l")
    assert config.rope_scaling == {"rope_type": "llama3", **{
        k: v for k, v in _LLAMA3_ROPE.items() if k != "rope_type"}}
    assert (config.attention_bias, config.o_proj_bias, config.mlp_bias) == (False, False, False)
    assert (config.bos_token_id, config.eos_token_ids) == (1, (7, 9))
