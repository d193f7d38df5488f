"""Greedy tokens equal HF transformers (fp32) on tiny random models, in four engine settings."""

import pytest

from kvtier import LLM, SamplingParams

from ..tiny_models import ARCHS, hf_greedy, make_hf_model, make_prompts

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(ARCHS))
def reference(request, tmp_path_factory):
    """(architecture, model dir, prompts, HF's greedy outputs)."""
    directory = tmp_path_factory.mktemp(request.param)
    model = make_hf_model(request.param, directory)
    prompts = make_prompts()
    return request.param, str(directory), prompts, hf_greedy(model, prompts, MAX_TOKENS)


def run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    llm.engine.check_invariants()
    return [out.outputs[0].token_ids for out in outputs]


def make_llm(directory: str, **options) -> LLM:
    return LLM(directory, dtype="float32", block_size=4, **options)


def test_prefix_caching_off(reference):
    _, directory, prompts, expected = reference
    llm = make_llm(directory, enable_prefix_caching=False, num_device_blocks=128)
    assert run(llm, prompts) == expected
    assert llm.get_metrics()["vllm:prefix_cache_hits"] == 0


def test_prefix_caching_on_with_repeated_prompts(reference):
    _, directory, prompts, expected = reference
    llm = make_llm(directory, num_device_blocks=128)
    assert run(llm, prompts) == expected
    hits_first = llm.get_metrics()["vllm:prefix_cache_hits"]
    assert run(llm, prompts) == expected
    metrics = llm.get_metrics()
    assert metrics["vllm:prefix_cache_hits"] > hits_first
    # The repeat finds every prompt cached but its last block (recomputed for logits).
    assert metrics["vllm:prefix_cache_hits"] - hits_first >= sum(
        (len(p) - 1) // 4 * 4 - 4 for p in prompts)


def test_chunked_prefill_with_a_small_token_budget(reference):
    _, directory, prompts, expected = reference
    llm = make_llm(directory, num_device_blocks=128, max_num_batched_tokens=7, max_num_seqs=3)
    assert run(llm, prompts) == expected


# Sliding-window layers free old blocks as they go, so Mistral needs a tighter cache to preempt.
TIGHT_CACHE_BLOCKS = {"llama": 14, "qwen3": 14, "mistral": 12, "qwen2": 24}


def test_a_cache_too_small_for_the_batch_preempts(reference):
    arch, directory, prompts, expected = reference
    llm = make_llm(directory, num_device_blocks=TIGHT_CACHE_BLOCKS[arch],
                   max_num_batched_tokens=64)
    assert run(llm, prompts) == expected
    assert llm.get_metrics()["vllm:num_preemptions"] > 0


@pytest.mark.gpu
def test_parity_on_cuda(reference):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _, directory, prompts, expected = reference
    llm = make_llm(directory, num_device_blocks=128, device="cuda", max_num_batched_tokens=7)
    assert run(llm, prompts) == expected
    assert run(llm, prompts) == expected
    assert llm.get_metrics()["vllm:prefix_cache_hits"] > 0
