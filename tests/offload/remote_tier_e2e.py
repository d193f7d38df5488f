"""End-to-end scenarios shared by the network-store tier tests (obj, redis): engines on a tiny
random Llama with a host tier and one store tier, checked token for token against HF greedy.

`tier` is the store tier's JSON config (the tests give each a prefix of its own, so tests that
share a server never see each other's chunks). Device and host tiers are small, so a prompt
served four prompts ago is on the store tier only.
"""

import time

from kvtier import LLM, SamplingParams
from kvtier.events import BlockStored

from ..tiny_models import hf_greedy, make_hf_model, random_prompts

PROMPT_LEN = 30  # 7 loadable blocks of 4 (the last token is always recomputed)
LOADABLE = 28
CHUNKS_PER_PROMPT = 7
# Stored per prompt: every full block with computed KV, decode blocks included (30 + 5 tokens
# generated, the last not yet computed: 34 tokens, 8 blocks).
STORED_CHUNKS_PER_PROMPT = 8
CHUNK_BYTES = 2 * 2 * 4 * 2 * 16 * 4  # layers * (K, V) * block * kv heads * head dim * fp32
MAX_TOKENS = 5
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def make_model(directory):
    """(model dir, 8 prompts, HF greedy continuations)."""
    hf = make_hf_model("llama", directory, max_position_embeddings=512)
    prompts = random_prompts(8, PROMPT_LEN, seed=3)
    return str(directory), prompts, hf_greedy(hf, prompts, MAX_TOKENS)


def make_llm(model_dir, tier, host_chunks=16, tier_job_timeout_s=30.0):
    # 24 device blocks hold 3 of the 8-block prompts; 16 host chunks hold 2 prompts.
    config = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {
        "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": host_chunks * CHUNK_BYTES,
        "tier_job_timeout_s": tier_job_timeout_s, "secondary_tiers": [tier]}}
    return LLM(model_dir, dtype="float32", block_size=4, num_device_blocks=24, max_num_seqs=2,
               kv_transfer_config=config, enable_kv_cache_events=True)


def generate(llm, prompts):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    return [o.outputs[0].token_ids for o in outputs], [o.num_cached_tokens for o in outputs]


def serve_one_by_one(llm, prompts, expected):
    """Each prompt alone, its stores on the tier ended before the next (so what reaches the
    tier does not depend on the store's speed)."""
    for prompt, want in zip(prompts, expected):
        assert generate(llm, [prompt])[0] == [want]
        flush(llm)


def flush(llm):
    llm.engine.step()  # the worker half reports the last step's copies on the next step
    assert llm.engine.scheduler.connector.flush(timeout_s=30), "stores to the tier hang"


def tier_metric(llm, name, tier_name):
    return llm.get_metrics().get(f'kvtier:offload_tier_{name}_total{{tier="{tier_name}"}}', 0.0)


def bytes_moved(llm, direction):
    return llm.get_metrics().get(f'kvtier:offload_bytes_total{{direction="{direction}"}}', 0.0)


def second_instance_gets_hits(model, flag, tier, name):
    """An engine configured by the one-flag form `flag` serves four prompts and exits; a second
    one, configured by the JSON form `tier`, with an empty host tier, loads every loadable chunk
    of those prompts from the store."""
    model_dir, prompts, expected = model
    first = LLM(model_dir, dtype="float32", block_size=4, num_device_blocks=24, max_num_seqs=2,
                kv_offload=f"host={16 * CHUNK_BYTES},{flag}")
    try:
        serve_one_by_one(first, prompts[:4], expected[:4])
        assert bytes_moved(first, f"host_to_{name}") == 4 * STORED_CHUNKS_PER_PROMPT * CHUNK_BYTES
    finally:
        first.engine.shutdown()
    second = make_llm(model_dir, tier, host_chunks=64)  # room for all four prompts' chunks
    try:
        start = time.monotonic()
        assert generate(second, prompts[:4]) == (expected[:4], [LOADABLE] * 4)
        assert time.monotonic() - start < 10  # no wait for a deadline
        assert tier_metric(second, "hits", name) == 4 * CHUNKS_PER_PROMPT
        assert tier_metric(second, "errors", name) == 0
        assert bytes_moved(second, f"{name}_to_host") == 4 * CHUNKS_PER_PROMPT * CHUNK_BYTES
        gets = [value for metric, value in second.get_metrics().items()
                if metric.startswith(f'kvtier:offload_store_request_seconds_count{{tier="{name}"')
                and 'op="get"' in metric]
        assert gets == [4 * CHUNKS_PER_PROMPT]  # one timed GET per chunk
        # Copies into host memory (the promotions) are local; copies in the store are remote.
        events = [e for e in second.engine.take_kv_events() if isinstance(e, BlockStored)]
        assert {e.locality for e in events if e.medium == "CPU"} == {"local"}
        assert {(e.medium, e.locality) for e in events if e.ownership == name} <= {
            ("STORAGE", "remote")}
        second.engine.check_invariants()
    finally:
        second.engine.shutdown()


def store_down_then_back(model, tier, name, kill, restart):
    """The store dies mid-run: output stays right and errors are counted; it comes back and the
    same engine gets hits again."""
    model_dir, prompts, expected = model
    llm = make_llm(model_dir, tier)
    try:
        serve_one_by_one(llm, prompts[:4], expected[:4])
        kill()
        serve_one_by_one(llm, prompts[4:7], expected[4:7])  # stores fail
        assert generate(llm, prompts[:1]) == (expected[:1], [0])  # on the tier, unreachable
        assert tier_metric(llm, "errors", name) > 0
        restart()
        assert _hits_resume(llm, prompts, expected, name)
        llm.engine.check_invariants()
    finally:
        llm.engine.shutdown()


def _hits_resume(llm, prompts, expected, name, num_tries=4):
    """Serve prompt 1 (stored anew if the tier lacks it), push it out of device and host memory
    and serve it again: True once all its chunks come from the tier. A store that just came back
    may fail the first calls (connections it closed, a server still starting), which costs a
    second of misses and dropped stores each: hence the tries."""
    for _ in range(num_tries):
        time.sleep(1.2)  # the tier's "down" mark lapses
        serve_one_by_one(llm, prompts[4:7], expected[4:7])  # out of device and host memory
        serve_one_by_one(llm, prompts[1:2], expected[1:2])
        serve_one_by_one(llm, prompts[4:7], expected[4:7])
        hits = tier_metric(llm, "hits", name)
        tokens, cached = generate(llm, prompts[1:2])
        assert tokens == expected[1:2]
        if cached == [LOADABLE] and tier_metric(llm, "hits", name) == hits + CHUNKS_PER_PROMPT:
            return True
    return False


def corrupt_values_recompute(model, tier, name, corrupt):
    """Every stored value is overwritten with garbage through the client library: a second
    engine counts one error per chunk, recomputes, and the bad values are deleted."""
    model_dir, prompts, expected = model
    first = make_llm(model_dir, tier)
    try:
        serve_one_by_one(first, prompts[:1], expected[:1])
    finally:
        first.engine.shutdown()
    names = corrupt()
    assert len(names) == STORED_CHUNKS_PER_PROMPT
    second = make_llm(model_dir, tier)
    try:
        assert generate(second, prompts[:1]) == (expected[:1], [0])
        assert tier_metric(second, "errors", name) == CHUNKS_PER_PROMPT
        assert bytes_moved(second, f"{name}_to_host") == 0
        second.engine.check_invariants()
    finally:
        second.engine.shutdown()


def paused_store_misses(model, tier, name, server):
    """A store that accepts connections and never answers (SIGSTOP) costs misses within the
    client timeouts, never a hang; after SIGCONT hits resume."""
    model_dir, prompts, expected = model
    llm = make_llm(model_dir, tier, tier_job_timeout_s=3.0)
    try:
        serve_one_by_one(llm, prompts[:4], expected[:4])
        server.pause()
        try:
            start = time.monotonic()
            assert generate(llm, prompts[:1]) == (expected[:1], [0])
            serve_one_by_one(llm, prompts[4:5], expected[4:5])
            assert time.monotonic() - start < 20
            assert tier_metric(llm, "errors", name) > 0
        finally:
            server.resume()
        assert _hits_resume(llm, prompts, expected, name)
        llm.engine.check_invariants()
    finally:
        llm.engine.shutdown()
