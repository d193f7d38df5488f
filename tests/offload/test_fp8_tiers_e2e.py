"""An fp8 KV cache (--kv-cache-dtype fp8) through the tiers: evicted blocks come back from host
memory and from a shared fs directory at one byte an element, the answers equal HF transformers
(fp32) over K and V rounded the same way, and an instance storing another format shares the
directory without reading a chunk of it (the format is part of the KV identity); a hybrid's
fp32 conv states travel beside its fp8 attention pages."""

import pytest
import torch

from kvtier import LLM, SamplingParams

from ..tiny_models import hf_greedy_rounded_kv, make_hf_model, make_lfm2_model, random_prompts
from .offload_helpers import flushed, generate, offload_bytes

PROMPT_LEN = 30  # 7 loadable blocks of 4 (the last token is always recomputed)
LOADABLE = 28
# layers * (K, V) * block * kv heads * head dim * one byte
CHUNK_BYTES = 2 * 2 * 4 * 2 * 16 * 1
MAX_TOKENS = 5
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama")
    hf = make_hf_model("llama", directory, max_position_embeddings=512)
    prompts = random_prompts(8, PROMPT_LEN)
    return str(directory), prompts, hf_greedy_rounded_kv(hf, prompts, MAX_TOKENS,
                                                         torch.float8_e4m3fn)


def _llm(model_dir, kv_offload, kv_cache_dtype="fp8"):
    # 24 device blocks hold 3 of the 8-block prompts: earlier ones get evicted from the device.
    return LLM(model_dir, dtype="float32", block_size=4, num_device_blocks=24, max_num_seqs=2,
               kv_cache_dtype=kv_cache_dtype, kv_offload=kv_offload)


def _generate(llm, prompts):
    return generate(llm, prompts, PARAMS)


def test_evicted_fp8_blocks_reload_from_host(model):
    model_dir, prompts, expected = model
    llm = _llm(model_dir, "host=1MiB")
    try:
        assert _generate(llm, prompts[:4]) == (expected[:4], [0, 0, 0, 0])
        assert _generate(llm, prompts[:1]) == (expected[:1], [LOADABLE])
        assert offload_bytes(llm, "host_to_device") == 7 * CHUNK_BYTES
    finally:
        llm.engine.shutdown()


def test_an_fs_directory_serves_its_format_only(model, tmp_path):
    model_dir, prompts, expected = model
    tier = f"host=1MiB,fs={tmp_path}:1MiB,write=through"
    writer = _llm(model_dir, tier)
    try:
        assert _generate(writer, prompts[:2])[0] == expected[:2]
        flushed(writer)
    finally:
        writer.engine.shutdown()
    other = _llm(model_dir, tier, kv_cache_dtype="fp8_e5m2")
    try:
        assert _generate(other, prompts[:2])[1] == [0, 0]  # nothing of fp8_e4m3's is read
    finally:
        other.engine.shutdown()
    reader = _llm(model_dir, tier)
    try:
        assert _generate(reader, prompts[:2]) == (expected[:2], [LOADABLE, LOADABLE])
    finally:
        reader.engine.shutdown()


def test_a_hybrids_fp8_attention_and_fp32_conv_states_reload_from_host(tmp_path):
    """LFM2 (a conv layer, an attention layer): one pool, pages of two dtypes; both come back
    from host memory, the attention page at one byte an element, the state as it was."""
    hf = make_lfm2_model("conv_attn", tmp_path, max_position_embeddings=512)
    prompts = random_prompts(8, PROMPT_LEN)
    expected = hf_greedy_rounded_kv(hf, prompts[:4], MAX_TOKENS, torch.float8_e4m3fn)
    llm = LLM(str(tmp_path), dtype="float32", block_size=4, num_device_blocks=48,
              max_num_seqs=2, kv_cache_dtype="fp8", kv_offload="host=1MiB")
    try:
        assert [c.dtype for c in llm.engine.runner.kv_caches] == [torch.float32,
                                                                   torch.float8_e4m3fn]
        assert _generate(llm, prompts[:4]) == (expected, [0] * 4)
        assert _generate(llm, prompts[:1]) == (expected[:1], [LOADABLE])
        attention = 2 * 4 * 2 * 16 * 1  # K and V, 4 slots x 2 kv heads x 16 dims, fp8
        state = (hf.config.conv_L_cache - 1) * 64 * 4  # one fp32 conv state
        # 7 attention chunks, and of the states only the one after token 28.
        assert offload_bytes(llm, "host_to_device") == 7 * attention + state
    finally:
        llm.engine.shutdown()
