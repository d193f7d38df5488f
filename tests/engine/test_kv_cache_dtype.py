"""--kv-cache-dtype fp8 / fp8_e5m2: greedy tokens equal HF transformers (fp32) whose attention
sees K and V rounded to the same format, through prefix hits, chunked prefill, preemption and
a hybrid model's fp32 conv states; the cache holds one byte an element; the format is part of
the KV identity, so stored chunks of another format are never read."""

import pytest
import torch

from kvtier import LLM, SamplingParams
from kvtier.config import EngineConfig

from ..tiny_models import (
    hf_greedy,
    hf_greedy_rounded_kv,
    make_hf_model,
    make_lfm2_model,
    make_prompts,
)

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
FORMATS = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2", "lfm2"])
def reference(request, tmp_path_factory):
    """(architecture, model dir, prompts, {format: HF's greedy outputs}, HF's unrounded
    outputs)."""
    directory = tmp_path_factory.mktemp(request.param)
    if request.param == "lfm2":  # short convolutions + attention: conv states stay fp32
        model = make_lfm2_model("conv_attn", directory)
    else:
        model = make_hf_model(request.param, directory)
    prompts = make_prompts()
    expected = {name: hf_greedy_rounded_kv(model, prompts, MAX_TOKENS, fmt)
                for name, fmt in FORMATS.items()}
    return request.param, str(directory), prompts, expected, hf_greedy(model, prompts,
                                                                       MAX_TOKENS)


def run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    llm.engine.check_invariants()
    return [out.outputs[0].token_ids for out in outputs]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_greedy_tokens_equal_hf_over_rounded_kv(reference, name):
    """Twice: the second pass reads the first's cached fp8 blocks (prefix hits) in chunks of at
    most 7 tokens, so chunk prefills attend staged fp8 pages."""
    _, directory, prompts, expected, _ = reference
    llm = LLM(directory, dtype="float32", block_size=4, num_device_blocks=128,
              kv_cache_dtype=name, max_num_batched_tokens=7)
    assert llm.engine.runner.kv_caches[-1].dtype in (FORMATS[name], torch.float32)
    assert run(llm, prompts) == expected[name]
    assert run(llm, prompts) == expected[name]
    assert llm.get_metrics()["vllm:prefix_cache_hits"] > 0


# Sliding windows free old blocks as they go; two groups (a window, conv states) take two
# blocks a block's worth of tokens.
TIGHT_CACHE_BLOCKS = {"llama": 14, "mistral": 12, "qwen2": 24, "lfm2": 24}


def test_a_cache_too_small_for_the_batch_preempts_and_recomputes(reference):
    arch, directory, prompts, expected, _ = reference
    llm = LLM(directory, dtype="float32", block_size=4, num_device_blocks=TIGHT_CACHE_BLOCKS[arch],
              kv_cache_dtype="fp8", max_num_batched_tokens=64)
    assert run(llm, prompts) == expected["fp8"]
    assert llm.get_metrics()["vllm:num_preemptions"] > 0


def test_rounding_changes_what_the_model_sees(reference):
    """The reference is not vacuous: on some prompt the rounded KV changes a greedy token."""
    _, _, _, expected, unrounded = reference
    assert expected["fp8_e5m2"] != unrounded or expected["fp8"] != unrounded


def test_fp8_holds_four_times_the_blocks_of_fp32_and_names_its_format(reference):
    directory = reference[1]
    memory = 4 * 2**20
    plain = LLM(directory, dtype="float32", block_size=4, kv_cache_memory_bytes=memory)
    fp8 = LLM(directory, dtype="float32", block_size=4, kv_cache_memory_bytes=memory,
              kv_cache_dtype="fp8")
    plain_runtime, fp8_runtime = plain.engine.runtime, fp8.engine.runtime
    attention = [c for c in fp8.engine.runner.kv_caches if c.dtype == torch.float8_e4m3fn]
    assert attention and all(c.element_size() == 1 for c in attention)
    if all(c.dtype == torch.float8_e4m3fn for c in fp8.engine.runner.kv_caches):
        assert fp8_runtime.num_blocks == 4 * plain_runtime.num_blocks
    else:  # a hybrid's fp32 conv state pages take their share of every block
        assert plain_runtime.num_blocks < fp8_runtime.num_blocks < 4 * plain_runtime.num_blocks
    assert plain_runtime.kv_identity.dtype == "float32"
    assert fp8_runtime.kv_identity.dtype == "float32+float8_e4m3fn"
    assert plain_runtime.namespace != fp8_runtime.namespace


def test_an_unknown_format_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, "
                                         "fp8_e5m2, got 'int4'"):
        EngineConfig.create(kv_cache_dtype="int4")


@pytest.mark.gpu
def test_fp8_on_cuda_equals_hf_over_rounded_kv(reference):
    """The device-agnostic paths: write_kv's byte copy, pages converted by torch."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _, directory, prompts, expected, _ = reference
    llm = LLM(directory, dtype="float32", block_size=4, num_device_blocks=128, device="cuda",
              kv_cache_dtype="fp8", max_num_batched_tokens=7)
    assert run(llm, prompts) == expected["fp8"]
    assert run(llm, prompts) == expected["fp8"]
