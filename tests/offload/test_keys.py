"""Chunk keys and their namespace: chunks of different sizes never share a key, end to end on a
tiny random Llama with two blocks_per_chunk settings on one fs directory."""

import json
import os

import pytest

from kvtier import LLM, SamplingParams
from kvtier.kv import KVIdentity
from kvtier.offload.keys import chunk_identity, make_chunk_key

from ..tiny_models import hf_greedy, make_hf_model, random_prompts

PROMPT_LEN = 30  # 7 full blocks of 4 before the last token
MAX_TOKENS = 5
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
IDENTITY = KVIdentity("m", "weights", "float32", 4, "layout", ("full_attention",))


def test_the_chunk_size_is_part_of_the_namespace():
    one, two = chunk_identity(IDENTITY, 1), chunk_identity(IDENTITY, 2)
    assert one.namespace != two.namespace != IDENTITY.namespace
    assert one == chunk_identity(IDENTITY, 1)
    last_block = bytes(32)
    # Chunk 1 of size 1 and chunk 0 of size 2 both end at block 1: only the namespace differs.
    assert make_chunk_key(one.namespace, 0, last_block) != make_chunk_key(two.namespace, 0,
                                                                          last_block)
    with pytest.raises(ValueError, match="group_id"):
        make_chunk_key(one.namespace, 1 << 16, last_block)


def _run(model_dir, store, prompts, blocks_per_chunk):
    """A fresh engine on `store`: (tokens, fs hits, fs errors)."""
    llm = LLM(model_dir, dtype="float32", block_size=4, num_device_blocks=64,
              kv_offload=f"host=1MiB,fs={store},blocks_per_chunk={blocks_per_chunk}")
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
        metrics = llm.get_metrics()
    finally:
        llm.engine.shutdown()  # waits for the chunks to reach the fs tier
    return ([o.outputs[0].token_ids for o in outputs],
            metrics.get('kvtier:offload_tier_hits_total{tier="fs"}', 0.0),
            metrics.get('kvtier:offload_tier_errors_total{tier="fs"}', 0.0))


def test_two_chunk_sizes_share_an_fs_directory_without_colliding(tmp_path):
    model_dir, store = str(tmp_path / "model"), tmp_path / "fs"
    prompts = random_prompts(3, PROMPT_LEN)
    expected = hf_greedy(make_hf_model("llama", model_dir), prompts, MAX_TOKENS)
    for blocks_per_chunk in (1, 2):
        assert _run(model_dir, store, prompts, blocks_per_chunk) == (expected, 0, 0)
    # Each setting finds its own chunks: 7 of one block, or 3 of two, per prompt.
    for blocks_per_chunk, num_chunks in ((1, 7), (2, 3)):
        assert _run(model_dir, store, prompts, blocks_per_chunk) == (expected, 3 * num_chunks,
                                                                     0)
    described = {}
    for namespace in os.listdir(store):
        with open(os.path.join(store, namespace, namespace + ".json")) as f:
            description = json.load(f)
        assert description["namespace"] == namespace
        described[description["blocks_per_chunk"]] = description
    assert sorted(described) == [1, 2]
    # Same weights, two chunk sizes: the description shows why the two do not share.
    assert described[1]["weights_digest"] == described[2]["weights_digest"]
