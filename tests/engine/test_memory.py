"""The KV cache is allocated once, and a long decode does not grow resident memory."""

import gc

from kvtier import LLM, SamplingParams

from ..tiny_models import make_hf_model


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def test_kv_cache_tensors_stay_put_and_rss_is_flat_over_1000_decode_steps(tmp_path):
    make_hf_model("llama", tmp_path, max_position_embeddings=1200)
    llm = LLM(str(tmp_path), dtype="float32", block_size=16, num_device_blocks=160)
    engine = llm.engine
    caches = engine.runner.kv_caches
    pointers = [cache.data_ptr() for cache in caches]
    assert [tuple(c.shape) for c in caches] == [(2, 160, 16, 2, 16)] * 2
    params = SamplingParams(temperature=0.0, max_tokens=1150, ignore_eos=True)
    engine.add_request("long", list(range(3, 11)), params)
    for _ in range(100):  # warm-up: allocator pools, lazy imports, first histogram buckets
        engine.step()
    gc.collect()
    before = rss_bytes()
    for _ in range(1000):
        outputs = engine.step()
    gc.collect()
    grown = rss_bytes() - before
    assert len(outputs[0].outputs[0].token_ids) == 1100  # one token per step, all still running
    assert [cache.data_ptr() for cache in engine.runner.kv_caches] == pointers
    assert engine.runner.kv_caches is caches
    # The request's own token lists grow by ~8 bytes a token; allow 2 MiB of noise.
    assert grown < 2 * 1024 * 1024, f"RSS grew by {grown} bytes over 1000 decode steps"
