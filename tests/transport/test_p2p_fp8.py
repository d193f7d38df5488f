"""P/D with an fp8 KV cache: the producer sends its fp8 pages as stored and the consumer
decodes with them token for token as HF over K and V rounded the same way; a consumer storing
another format takes no transfer (the namespaces differ) and computes the prompt itself, as an
instance of its own format would."""

from __future__ import annotations

import time

import torch

from tests.tiny_models import hf_greedy, hf_greedy_rounded_kv, make_block_prompts, make_hf_model
from tests.transport.p2p_helpers import MAX_TOKENS, engine_pair, hand_over, loaded_tokens


def test_fp8_pages_travel_as_stored_and_decode_as_hf_over_rounded_kv(tmp_path):
    hf = make_hf_model("llama", tmp_path)
    prompts = make_block_prompts()
    expected = hf_greedy_rounded_kv(hf, prompts, MAX_TOKENS, torch.float8_e4m3fn)
    with engine_pair(str(tmp_path), kv_cache_dtype="fp8", consumer_kv_cache_dtype="fp8") as (
            producer, consumer):
        _, decodes = hand_over(producer, consumer, prompts)
        assert [d.outputs[0].token_ids for d in decodes] == expected
        assert [d.num_cached_tokens for d in decodes] == [loaded_tokens(p) for p in prompts]
        # (19, 16, 13, 23, 6 tokens) -> 4, 3, -, 5, 1 blocks; the third found locally.
        assert consumer.get_metrics()["kvtier:p2p_connector_blocks_loaded"] == 13


def test_a_consumer_of_another_format_computes_the_prompt_at_once(tmp_path):
    """The producer's kv_transfer_params name its KV namespace: the consumer sees it is not its
    own and computes the prompt without waiting for a load (it would wait out its 2 s
    kv_load_timeout_s per request: the producer's handshake is refused)."""
    hf = make_hf_model("llama", tmp_path)
    prompts = make_block_prompts()[:2]
    with engine_pair(str(tmp_path), kv_cache_dtype="fp8") as (producer, consumer):
        start = time.monotonic()
        prefills, decodes = hand_over(producer, consumer, prompts)
        elapsed = time.monotonic() - start
        assert [d.outputs[0].token_ids for d in decodes] == hf_greedy(hf, prompts, MAX_TOKENS)
        assert [d.num_cached_tokens for d in decodes] == [0, 0]
        assert consumer.get_metrics().get("kvtier:p2p_connector_blocks_loaded", 0.0) == 0
        assert [p.kv_transfer_params["kv_namespace"] for p in prefills] == [
            producer.engine.runtime.namespace.hex()] * 2
        assert producer.engine.runtime.namespace != consumer.engine.runtime.namespace
        assert elapsed < 2.0
