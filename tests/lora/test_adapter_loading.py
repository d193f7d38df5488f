"""What an adapter directory must hold, and the clear errors for everything kvtier refuses."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvtier import LLM, LoRARequest, SamplingParams
from kvtier.lora import LoRAError
from tests.lora.adapters import make_adapter
from tests.tiny_models import make_hf_model, make_lfm2_model

PROMPT = [{"prompt_token_ids": [5, 6, 7, 8, 9]}]
ONE = SamplingParams(max_tokens=1, temperature=0.0)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_load")
    base = make_hf_model("llama", root / "base")
    make_adapter(base, root / "good", seed=1)
    llm = LLM(str(root / "base"), dtype="float32", enable_lora=True, max_lora_rank=8)
    return root, llm


def _copy(root, tmp_path, edit_config=None, edit_tensors=None):
    """A copy of the good adapter, its config and tensors edited."""
    target = tmp_path / "edited"
    shutil.copytree(root / "good", target)
    if edit_config is not None:
        config = json.loads((target / "adapter_config.json").read_text())
        edit_config(config)
        (target / "adapter_config.json").write_text(json.dumps(config))
    if edit_tensors is not None:
        tensors = load_file(target / "adapter_model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, target / "adapter_model.safetensors")
    return str(target)


def _refused(llm, path, *fragments):
    with pytest.raises(LoRAError) as info:
        llm.generate(PROMPT, ONE, lora_request=LoRARequest("x", 1, path))
    for fragment in fragments:
        assert fragment in str(info.value)


def _set(key, value):
    return lambda config: config.__setitem__(key, value)


@pytest.mark.parametrize("edit, fragments", [
    (_set("use_dora", True), ("use_dora is not supported",)),
    (_set("bias", "all"), ("bias 'all' is not supported",)),
    (_set("modules_to_save", ["lm_head"]), ("modules_to_save",)),
    (_set("peft_type", "IA3"), ('"peft_type": "LORA"',)),
    (_set("lora_alpha", 0), ("lora_alpha must be a positive finite number",)),
    # Python's json reads these (NaN, Infinity, an int past float's range) without a word.
    (_set("lora_alpha", float("nan")), ("lora_alpha must be a positive finite number",
                                         "got nan")),
    (_set("lora_alpha", float("inf")), ("lora_alpha must be a positive finite number",)),
    (_set("lora_alpha", 10 ** 400), ("lora_alpha must be a positive finite number",)),
], ids=["dora", "bias", "modules_to_save", "peft_type", "lora_alpha", "nan_alpha",
        "inf_alpha", "huge_alpha"])
def test_unsupported_config_options_are_refused(setup, tmp_path, edit, fragments):
    root, llm = setup
    _refused(llm, _copy(root, tmp_path, edit_config=edit), *fragments)


def test_tensor_problems_are_refused(setup, tmp_path):
    root, llm = setup
    a_name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"

    def wider(tensors):
        tensors[a_name] = torch.zeros(4, 65)

    _refused(llm, _copy(root, tmp_path / "1", edit_tensors=wider),
             "'model.layers.0.self_attn.q_proj' has lora_A (4, 65)", "another base model")

    def embedding(tensors):
        tensors["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.zeros(4, 128)

    _refused(llm, _copy(root, tmp_path / "2", edit_tensors=embedding), "unexpected tensor")

    def lone_a(tensors):
        del tensors[a_name.replace("lora_A", "lora_B")]

    _refused(llm, _copy(root, tmp_path / "3", edit_tensors=lone_a), "only one of lora_A")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_at_load(setup, tmp_path, value):
    """Such an adapter once loaded, then failed every request using it at sampling."""
    root, llm = setup
    b_name = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"

    def poison(tensors):
        tensors[b_name][0, 0] = value

    _refused(llm, _copy(root, tmp_path, edit_tensors=poison),
             "'model.layers.1.mlp.down_proj' lora_B holds NaN or infinite values")


def test_rank_above_max_lora_rank_is_refused(setup, tmp_path):
    root, llm = setup
    base = make_hf_model("llama", tmp_path / "base")
    make_adapter(base, tmp_path / "r16", seed=1, r=16)
    _refused(llm, str(tmp_path / "r16"), "rank 16 is greater than max_lora_rank 8",
             "--max-lora-rank")


def test_missing_and_pickled_weights_are_refused(setup, tmp_path):
    root, llm = setup
    _refused(llm, str(tmp_path / "nowhere"), "no adapter_config.json")
    path = _copy(root, tmp_path)
    (tmp_path / "edited" / "adapter_model.safetensors").rename(
        tmp_path / "edited" / "adapter_model.bin")
    _refused(llm, path, "adapter_model.bin is a pickle", "safe_serialization=True")


def test_a_module_kvtier_cannot_adapt_is_refused(tmp_path):
    """LFM2's short convolution projections are not LoRA targets."""
    base = make_lfm2_model("conv_attn", tmp_path / "base")
    make_adapter(base, tmp_path / "conv", seed=1, targets=("in_proj",))
    llm = LLM(str(tmp_path / "base"), dtype="float32", enable_lora=True)
    _refused(llm, str(tmp_path / "conv"), "'model.layers.0.conv.in_proj'",
             "q/k/v/o_proj")


def test_names_paths_and_lora_off(setup, tmp_path):
    root, llm = setup
    good = LoRARequest("good", 1, str(root / "good"))
    llm.generate(PROMPT, ONE, lora_request=good)
    # The loaded name alone is enough; another path under it is refused.
    llm.generate(PROMPT, ONE, lora_request=LoRARequest("good", 1))
    with pytest.raises(LoRAError, match="already loaded from"):
        llm.generate(PROMPT, ONE, lora_request=LoRARequest("good", 1, _copy(root, tmp_path)))
    with pytest.raises(LoRAError, match="not loaded and the request gives no lora_path"):
        llm.generate(PROMPT, ONE, lora_request=LoRARequest("other", 2))
    plain = LLM(str(root / "base"), dtype="float32")
    with pytest.raises(LoRAError, match="--enable-lora"):
        plain.generate(PROMPT, ONE, lora_request=good)
    with pytest.raises(LoRAError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("a", 0, "p")
    with pytest.raises(ValueError, match="got 2 lora_request for 1 prompts"):
        llm.generate(PROMPT, ONE, lora_request=[good, good])
