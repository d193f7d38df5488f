"""LFM2 (short convolutions + attention): config parsing, and greedy tokens equal to HF
transformers (fp32) cold, in chunks across block boundaries, batched, and resumed from cached
conv states; the KV cache invariants hold and no state page leaks after every scenario."""

import json

import pytest

from kvtier import LLM, SamplingParams
from kvtier.models import ModelLoadError
from kvtier.models.hf_config import parse_hf_config

from ..tiny_models import LFM2_MIXES, hf_greedy, make_lfm2_model, make_prompts, random_prompts

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
BLOCK_SIZE = 4

_LFM2_OLD_STYLE = {
    "architectures": ["Lfm2ForCausalLM"], "vocab_size": 100, "hidden_size": 64,
    "block_ff_dim": 300, "intermediate_size": 12, "block_multiple_of": 64,
    "block_ffn_dim_multiplier": 1.5, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "rope_theta": 1000000.0, "norm_eps": 1e-5,
    "full_attn_idxs": [1, 3], "conv_L_cache": 4, "tie_embedding": True,
}


def _write_config(directory, config: dict) -> str:
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def test_old_style_config_lists_attention_layers(tmp_path):
    config = parse_hf_config(_write_config(tmp_path, _LFM2_OLD_STYLE), "lfm2-old")
    assert config.architecture == "lfm2"
    assert config.conv_layer_indices == (0, 2)
    assert config.conv_kernel_size == 4
    # 300 * 2/3 = 200, * 1.5 = 300, up to a multiple of 64 = 320
    assert config.intermediate_size == 320
    assert (config.tie_word_embeddings, config.qk_norm, config.rms_norm_eps) == (True, True, 1e-5)
    assert config.layer_names == ("model.layers.0.conv", "model.layers.1.self_attn",
                                  "model.layers.2.conv", "model.layers.3.self_attn")
    groups = config.kv_cache_groups()
    assert [(g.group_id, g.kind, g.layer_indices) for g in groups] == [
        (0, "attention", (1, 3)), (1, "short_conv", (0, 2))]
    assert config.layer_group_ids == (1, 0, 1, 0)


def test_conv_layers_in_a_llama_config_are_refused(tmp_path):
    raw = {**_LFM2_OLD_STYLE, "architectures": ["LlamaForCausalLM"], "intermediate_size": 96,
           "layer_types": ["conv", "full_attention", "conv", "full_attention"]}
    with pytest.raises(ModelLoadError, match="layer_types entry 'conv' is not supported"):
        parse_hf_config(_write_config(tmp_path, raw), "bad")


@pytest.fixture(scope="module", params=sorted(LFM2_MIXES))
def reference(request, tmp_path_factory):
    """(model dir, prompts, HF's greedy outputs, HF model) for each layer mix."""
    directory = tmp_path_factory.mktemp(request.param)
    model = make_lfm2_model(request.param, directory)
    prompts = make_prompts()
    return str(directory), prompts, hf_greedy(model, prompts, MAX_TOKENS), model


def make_llm(directory: str, **options) -> LLM:
    return LLM(directory, dtype="float32", block_size=BLOCK_SIZE,
               **{"num_device_blocks": 256, **options})


def run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy outputs; then every block is back in the free pool (no state page leaked)."""
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    engine = llm.engine
    engine.check_invariants()
    manager = engine.kv_cache_manager
    assert manager.num_free_blocks == manager.kv_cache_config.num_blocks - 1
    return [out.outputs[0].token_ids for out in outputs]


def test_the_conv_layers_get_a_state_group(reference):
    directory, *_ = reference
    llm = make_llm(directory)
    groups = llm.engine.kv_cache_manager.kv_cache_config.kv_cache_groups
    assert [g.kv_cache_spec.kind for g in groups] == ["full_attention", "mamba"]
    assert all(name.endswith(".conv") for name in groups[1].layer_names)


def test_cold_without_prefix_caching(reference):
    directory, prompts, expected, _ = reference
    llm = make_llm(directory, enable_prefix_caching=False)
    assert run(llm, prompts) == expected
    assert llm.get_metrics()["vllm:prefix_cache_hits"] == 0


def test_chunked_prefill_across_block_boundaries(reference):
    # 7-token chunks start and end off the 4-token block boundaries, several per prompt.
    directory, prompts, expected, _ = reference
    llm = make_llm(directory, enable_prefix_caching=False, max_num_batched_tokens=7,
                   max_num_seqs=3)
    assert run(llm, prompts) == expected


def test_prefix_hits_resume_from_cached_conv_states(reference):
    directory, prompts, expected, _ = reference
    llm = make_llm(directory)
    # Four prompts share a 12-token prefix: the later ones hit it within the first run.
    assert run(llm, prompts) == expected
    hits_first = llm.get_metrics()["vllm:prefix_cache_hits"]
    assert hits_first > 0
    assert run(llm, prompts) == expected
    hits = llm.get_metrics()["vllm:prefix_cache_hits"] - hits_first
    # Every prompt resumes from its last full block before the last token: all of them cached.
    assert hits == sum((len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in prompts)


def test_chunked_prefix_hits_with_preemption(reference):
    directory, prompts, expected, _ = reference
    llm = make_llm(directory, num_device_blocks=24, max_num_batched_tokens=16)
    assert run(llm, prompts) == expected
    assert run(llm, prompts) == expected
    assert llm.get_metrics()["vllm:num_preemptions"] > 0


def test_a_longer_prompt_extends_a_cached_one(reference):
    """The second prompt continues the first past its cached blocks, off a block boundary."""
    directory, _, _, model = reference
    first = random_prompts(1, 21, seed=5)[0]
    second = first + random_prompts(1, 10, seed=6)[0]
    expected = hf_greedy(model, [first, second], MAX_TOKENS)
    llm = make_llm(directory, max_num_batched_tokens=9)
    assert run(llm, [first]) == expected[:1]
    assert run(llm, [second]) == expected[1:]
    assert llm.get_metrics()["vllm:prefix_cache_hits"] == 20


@pytest.mark.gpu
def test_parity_on_cuda(reference):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    directory, prompts, expected, _ = reference
    llm = make_llm(directory, device="cuda", max_num_batched_tokens=7)
    assert run(llm, prompts) == expected
    assert run(llm, prompts) == expected
    assert llm.get_metrics()["vllm:prefix_cache_hits"] > 0
