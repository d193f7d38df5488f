"""Blocks filled by decoding are offloaded (unless `offload_prompt_only`): a conversation's next
turn starts with them. A tiny random Llama, fp32, greedy, checked against HF transformers."""

import pytest

from kvtier import LLM, SamplingParams
from kvtier.offload.config import CONNECTOR_NAME, parse_kv_offload

from ..tiny_models import hf_greedy, make_hf_model, random_prompts

BLOCK = 4
NUM_GENERATED = 100
# 2 prompt tokens + 100 generated: the KV of 101 tokens is computed, 25 whole blocks.
NUM_DECODE_CHUNKS = 25
CHUNK_BYTES = 2 * 2 * BLOCK * 2 * 16 * 4  # layers * (K, V) * block * kv heads * head dim * fp32


@pytest.fixture(scope="module")
def conversation(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama-decode")
    hf = make_hf_model("llama", directory, max_position_embeddings=512)
    first = random_prompts(1, 2, seed=3)[0]
    answer = hf_greedy(hf, [first], NUM_GENERATED)[0]
    follow_up = first + answer + random_prompts(1, 2, seed=4)[0]
    return str(directory), first, answer, follow_up, hf_greedy(hf, [follow_up], 5)[0]


def _llm(model_dir, directory, prompt_only=False):
    extra = {**parse_kv_offload(f"host=1MiB,fs={directory}"), "offload_prompt_only": prompt_only}
    return LLM(model_dir, dtype="float32", block_size=BLOCK, num_device_blocks=64,
               max_num_seqs=2, kv_transfer_config={"kv_connector": CONNECTOR_NAME,
                                                   "kv_connector_extra_config": extra})


def _generate(llm, prompt, max_tokens):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    return out.outputs[0].token_ids, out.num_cached_tokens


def _stored_bytes(llm):
    return llm.get_metrics().get('kvtier:offload_bytes_total{direction="device_to_host"}', 0.0)


@pytest.mark.parametrize("prompt_only", [False, True])
def test_decode_blocks_reach_the_tier_and_the_next_turn_loads_them(conversation, tmp_path,
                                                                   prompt_only):
    model_dir, first, answer, follow_up, expected = conversation
    llm = _llm(model_dir, tmp_path, prompt_only)
    try:
        assert _generate(llm, first, NUM_GENERATED) == (answer, 0)
        stored = _stored_bytes(llm)
    finally:
        llm.engine.shutdown()  # writes what host memory holds to the fs tier
    assert stored == (0 if prompt_only else NUM_DECODE_CHUNKS * CHUNK_BYTES)
    # A new instance on the same directory: the follow-up turn's prefix can only come from the
    # fs tier. Its 104 tokens have 25 loadable blocks (the last token is always recomputed).
    llm = _llm(model_dir, tmp_path)
    try:
        tokens, cached = _generate(llm, follow_up, 5)
    finally:
        llm.engine.shutdown()
    assert tokens == expected
    assert cached == (0 if prompt_only else NUM_DECODE_CHUNKS * BLOCK)
