"""Which projections carry biases follows transformers per architecture: Llama reads
attention_bias and mlp_bias, Qwen3 attention_bias only, Qwen2 always biases q/k/v, Mistral and
LFM2 read neither. The logits then equal HF transformers' (fp32)."""

import json

import pytest
import torch

from kvtier.models import ModelLoadError, load_model

from ..tiny_models import make_hf_model, make_lfm2_model
from .helpers import PagedDriver, hf_logits

PROMPT = [5, 70, 33, 100, 9, 9, 41, 4, 120, 3, 17]


def _bias_flags(loaded) -> tuple[bool, bool, bool]:
    config = loaded.config
    return config.attention_bias, config.o_proj_bias, config.mlp_bias


@pytest.mark.parametrize("arch, expected", [
    ("llama", (True, True, True)), ("qwen3", (True, True, False)),
    ("qwen2", (True, False, False)), ("mistral", (False, False, False))])
def test_bias_keys_are_read_as_transformers_reads_them(tmp_path, arch, expected):
    """Before, Llama's mlp_bias checkpoint failed on "unexpected tensor '...mlp.down_proj.bias'"
    and Mistral's attention_bias config on missing q/k/v/o biases HF never creates."""
    hf_model = make_hf_model(arch, tmp_path, attention_bias=True, mlp_bias=True)
    loaded = load_model(str(tmp_path), dtype=torch.float32)
    assert _bias_flags(loaded) == expected
    driver = PagedDriver(loaded.model)
    torch.testing.assert_close(driver.step({0: PROMPT})[0], hf_logits(hf_model, PROMPT),
                               atol=1e-4, rtol=0)
    torch.testing.assert_close(driver.step({0: [17]})[0][-1],
                               hf_logits(hf_model, PROMPT + [17])[-1], atol=1e-4, rtol=0)


def test_lfm2_ignores_attention_and_mlp_bias_as_transformers_does(tmp_path):
    """Before: "missing tensors: ...q_proj.bias" (kvtier gave LFM2 q/k/v biases)."""
    make_lfm2_model("conv_attn", tmp_path, attention_bias=True, mlp_bias=True)
    assert _bias_flags(load_model(str(tmp_path), dtype=torch.float32)) == (False, False, False)


def _rewrite_config(directory, **changes) -> None:
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize("saved, config, message", [
    ({"mlp_bias": True}, {"mlp_bias": False},
     r"unexpected tensor 'model\.layers\.0\.mlp\.down_proj\.bias'; the model has the biases "
     r"its architecture and config give it \(config\.json's attention_bias and mlp_bias"),
    ({"attention_bias": False}, {"attention_bias": True},
     r"missing tensors: model\.layers\.0\.self_attn\.k_proj\.bias, .*; the model has the "
     r"biases its architecture and config give it"),
])
def test_bias_tensors_that_disagree_with_the_config_are_refused_naming_the_keys(
        tmp_path, saved, config, message):
    make_hf_model("llama", tmp_path, **saved)
    _rewrite_config(tmp_path, **config)
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(tmp_path), dtype=torch.float32)
