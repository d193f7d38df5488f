"""Speculative decoding in the engine: greedy outputs are the same tokens as without it
(checked against HF transformers in fp32 too), for every attention architecture, through
chunked prefill, prefix hits, preemption and offloading, and next to requests that do not
speculate. The drafts must be kept sometimes (counted), or the multi-token path is untested."""

import pytest

from kvtier import LLM, SamplingParams

from ..tiny_models import hf_greedy, make_hf_model, make_lfm2_model, make_prompts

MAX_TOKENS = 24
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
               "prompt_lookup_max": 3}
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def run(directory, prompts, params, **options):
    llm = LLM(directory, dtype="float32", block_size=4, max_num_batched_tokens=32, **options)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        llm.engine.check_invariants()
        return [o.outputs[0] for o in outputs], llm.get_metrics()
    finally:
        llm.engine.shutdown()


def accepted(metrics) -> float:
    return metrics["vllm:spec_decode_num_accepted_tokens_total"]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral", "qwen2"])
def test_greedy_outputs_match_hf_with_drafts_kept(arch, tmp_path):
    model = make_hf_model(arch, tmp_path)
    prompts = make_prompts()
    outputs, metrics = run(str(tmp_path), prompts, GREEDY, num_device_blocks=256,
                           speculative_config=SPECULATIVE)
    assert [o.token_ids for o in outputs] == hf_greedy(model, prompts, MAX_TOKENS)
    assert accepted(metrics) > 0
    assert metrics["vllm:spec_decode_num_draft_tokens_total"] >= accepted(metrics)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    make_hf_model("llama", directory)
    return str(directory)


def test_preemption_and_a_small_cache_change_nothing(llama):
    prompts = make_prompts() * 2
    plain, _ = run(llama, prompts, GREEDY, num_device_blocks=256)
    tight, metrics = run(llama, prompts, GREEDY, num_device_blocks=24,
                         speculative_config=SPECULATIVE)
    assert metrics["vllm:num_preemptions_total"] > 0 and accepted(metrics) > 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in plain]


def test_eos_and_max_tokens_end_a_step_of_several_tokens(llama):
    # EOS allowed and short, varied limits: a kept draft may hold EOS or run past the limit.
    prompts = make_prompts()
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in (1, 2, 3, 5, 8, 13, 21)]
    plain, _ = run(llama, prompts, params, num_device_blocks=256)
    spec, _ = run(llama, prompts, params, num_device_blocks=256, speculative_config=SPECULATIVE)
    assert [(o.token_ids, o.finish_reason) for o in spec] == \
        [(o.token_ids, o.finish_reason) for o in plain]
    assert all(len(o.token_ids) <= p.max_tokens for o, p in zip(spec, params))


def test_requests_that_do_not_speculate_are_unchanged_beside_those_that_do(llama):
    prompts = make_prompts()
    params = [GREEDY,
              SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                             stop=["never"]),
              SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                             logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                             repetition_penalty=1.3),
              GREEDY, GREEDY,
              SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                             min_tokens=4)]
    plain, _ = run(llama, prompts, params, num_device_blocks=256)
    spec, metrics = run(llama, prompts, params, num_device_blocks=256,
                        speculative_config=SPECULATIVE)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert spec[2].logprobs == plain[2].logprobs
    assert metrics["vllm:spec_decode_num_draft_tokens_total"] > 0


def test_sampled_requests_draft_and_seeded_ones_get_their_tokens_without_drafts(llama):
    # Low temperature: the tiny model repeats itself, so drafts are found and kept.
    prompts = make_prompts()
    sampled = [SamplingParams(temperature=0.3, top_p=0.95, max_tokens=MAX_TOKENS,
                              ignore_eos=True) for _ in prompts]
    outputs, metrics = run(llama, prompts, sampled, num_device_blocks=256,
                           speculative_config=SPECULATIVE)
    assert accepted(metrics) > 0
    assert all(len(o.token_ids) == MAX_TOKENS for o in outputs)
    # A seeded request's tokens must not depend on its batch, and how many drafts it would
    # get (each one a draw from its generator) does: it takes none.
    seeded = [SamplingParams(temperature=0.3, top_p=0.95, seed=i, max_tokens=MAX_TOKENS,
                             ignore_eos=True) for i in range(len(prompts))]
    plain, _ = run(llama, prompts, seeded, num_device_blocks=256)
    spec, metrics = run(llama, prompts, seeded, num_device_blocks=256,
                        speculative_config=SPECULATIVE)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert metrics["vllm:spec_decode_num_draft_tokens_total"] == 0


def test_offloading_keeps_the_same_outputs(llama):
    prompts = make_prompts()
    plain, _ = run(llama, prompts, GREEDY, num_device_blocks=256)
    for _ in range(2):  # the second pass loads from host memory what the first stored
        offloaded, _ = run(llama, prompts, GREEDY, num_device_blocks=256,
                           kv_offload="host=64MiB", speculative_config=SPECULATIVE)
        assert [o.token_ids for o in offloaded] == [o.token_ids for o in plain]


def test_a_model_with_recurrent_state_is_refused(tmp_path):
    make_lfm2_model("conv_attn", tmp_path)
    with pytest.raises(ValueError, match="speculative decoding needs an attention-only model"):
        LLM(str(tmp_path), dtype="float32", num_device_blocks=64,
            speculative_config=SPECULATIVE)
