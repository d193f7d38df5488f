"""The KV identity the engine derives at start-up, end to end on a tiny random Llama: the
namespace follows the weights' content, so a shared tier never serves another model's KV."""

import json
import os

from kvtier import LLM, SamplingParams

from ..tiny_models import hf_greedy, make_hf_model, random_prompts

PROMPT_LEN = 30  # 7 full blocks of 4 before the last token
MAX_TOKENS = 5
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _run(model_dir, store, prompts):
    """A fresh engine (empty device and host tiers) on `store`: (tokens, fs hits, identity)."""
    llm = LLM(str(model_dir), dtype="float32", block_size=4, num_device_blocks=64,
              kv_offload=f"host=1MiB,fs={store}")
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
        metrics = llm.get_metrics()
        assert metrics.get('kvtier:offload_tier_errors_total{tier="fs"}', 0.0) == 0
        hits = metrics.get('kvtier:offload_tier_hits_total{tier="fs"}', 0.0)
        return [o.outputs[0].token_ids for o in outputs], hits, llm.engine.runtime.kv_identity
    finally:
        llm.engine.shutdown()  # waits for the chunks to reach the fs tier


def test_weights_replaced_at_the_same_path_never_load_the_old_kv(tmp_path):
    model_dir, store = tmp_path / "model", tmp_path / "fs"
    prompts = random_prompts(3, PROMPT_LEN)
    old = hf_greedy(make_hf_model("llama", model_dir, seed=0), prompts, MAX_TOKENS)
    tokens, hits, old_identity = _run(model_dir, store, prompts)
    assert (tokens, hits) == (old, 0)

    new = hf_greedy(make_hf_model("llama", model_dir, seed=1), prompts, MAX_TOKENS)
    assert new != old  # else the check below proves nothing
    tokens, hits, new_identity = _run(model_dir, store, prompts)
    assert (tokens, hits) == (new, 0)
    assert new_identity.weights_digest != old_identity.weights_digest

    # The same weights at the same path share: every prompt chunk comes from the fs tier.
    tokens, hits, again = _run(model_dir, store, prompts)
    assert again == new_identity
    assert (tokens, hits) == (new, 3 * 7)


def test_the_fs_namespace_directory_describes_the_identity(tmp_path):
    model_dir, store = tmp_path / "model", tmp_path / "fs"
    prompts = random_prompts(1, PROMPT_LEN)
    make_hf_model("llama", model_dir)
    _, _, identity = _run(model_dir, store, prompts)
    [namespace] = os.listdir(store)
    with open(os.path.join(store, namespace, namespace + ".json")) as f:
        description = json.load(f)
    assert description == {**identity.extended(blocks_per_chunk=1, chunk_format="KVTC/1")
                           .describe(), "format": "KVTC/1"}
    assert description["namespace"] == namespace
    assert description["weights_digest"] == identity.weights_digest
    assert description["blocks_per_chunk"] == 1
    assert description["model"] == str(model_dir)
