"""Logit bias and presence / frequency / repetition penalties, token for token against HF
transformers (fp32, greedy, a tiny random Llama): its own logits processors where it has them
(repetition_penalty, sequence_bias), its logits with the penalty applied step by step where it
does not (frequency and presence). Greedy decoding of a tiny random model repeats itself, so each
setting changes the output (checked): a test passes only if the setting is applied right."""

import pytest
import torch

from kvtier import LLM, SamplingParams

from ..tiny_models import hf_greedy, make_hf_model, make_prompts

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(model dir, HF model, prompts, HF's plain greedy outputs)."""
    directory = tmp_path_factory.mktemp("llama")
    model = make_hf_model("llama", directory)
    prompts = make_prompts()
    return str(directory), model, prompts, hf_greedy(model, prompts, MAX_TOKENS)


@pytest.fixture(scope="module")
def llm(reference):
    # Small blocks and a small budget: the prompts prefill in chunks and batch with each other.
    llm = LLM(reference[0], dtype="float32", block_size=4, num_device_blocks=128,
              max_num_batched_tokens=16)
    yield llm
    llm.engine.shutdown()


def kvtier_greedy(llm: LLM, prompts: list[list[int]], **options) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **options)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    llm.engine.check_invariants()
    return [out.outputs[0].token_ids for out in outputs]


def hf_generate(model, prompts: list[list[int]], **options) -> list[list[int]]:
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            generated = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS,
                                       min_new_tokens=MAX_TOKENS, do_sample=False,
                                       pad_token_id=0, **options)
            outputs.append(generated[0, len(prompt):].tolist())
    return outputs


def hf_penalized_greedy(model, prompts: list[list[int]], frequency: float,
                        presence: float) -> list[list[int]]:
    """HF's logits for each step, less frequency x count and presence x (count > 0) of each
    token generated so far, then the argmax (min_new_tokens: EOS never chosen)."""
    outputs = []
    eos = model.config.eos_token_id
    with torch.no_grad():
        for prompt in prompts:
            generated: list[int] = []
            for _ in range(MAX_TOKENS):
                logits = model(torch.tensor([prompt + generated])).logits[0, -1]
                counts = torch.bincount(torch.tensor(generated, dtype=torch.long),
                                        minlength=logits.shape[-1]).to(logits.dtype)
                logits = logits - frequency * counts - presence * (counts > 0)
                logits[eos] = float("-inf")
                generated.append(int(logits.argmax()))
            outputs.append(generated)
    return outputs


def test_repetition_penalty_matches_hf(reference, llm):
    _, model, prompts, plain = reference
    expected = hf_generate(model, prompts, repetition_penalty=1.8)
    assert expected != plain
    assert kvtier_greedy(llm, prompts, repetition_penalty=1.8) == expected


def test_logit_bias_matches_hf_sequence_bias(reference, llm):
    _, model, prompts, plain = reference
    # Push away the tokens the plain run picks first, pull in one it never picks.
    bias = {plain[0][0]: -4.0, plain[3][0]: -2.5, 7: 1.5}
    expected = hf_generate(model, prompts,
                           sequence_bias={(token,): value for token, value in bias.items()})
    assert expected != plain
    assert kvtier_greedy(llm, prompts, logit_bias=bias) == expected


@pytest.mark.parametrize("frequency, presence", [(0.8, 0.0), (0.0, 1.2), (1.5, -0.5)])
def test_frequency_and_presence_penalties_match_hf_logits_penalized(reference, llm, frequency,
                                                                     presence):
    _, model, prompts, plain = reference
    expected = hf_penalized_greedy(model, prompts, frequency, presence)
    assert expected != plain
    assert kvtier_greedy(llm, prompts, frequency_penalty=frequency,
                         presence_penalty=presence) == expected


def test_penalized_and_plain_requests_batched_together_get_their_own_tokens(reference, llm):
    _, model, prompts, plain = reference
    penalized = hf_generate(model, prompts[:3], repetition_penalty=1.8)
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                             repetition_penalty=1.8 if i < 3 else 1.0)
              for i in range(len(prompts))]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outputs] == penalized + plain[3:]


def test_a_logit_bias_token_outside_the_vocabulary_is_refused(llm):
    with pytest.raises(ValueError, match="logit_bias holds token id 100000, outside the "):
        kvtier_greedy(llm, [[5, 6, 7]], logit_bias={100000: 1.0})
    assert not llm.engine.has_unfinished_requests()


def test_penalties_survive_preemption(reference):
    # 14 blocks of 4 cannot hold the batch: requests are preempted and recomputed, and their
    # generated tokens must still count as generated, not as prompt.
    directory, model, prompts, _ = reference
    llm = LLM(directory, dtype="float32", block_size=4, num_device_blocks=14)
    try:
        expected = hf_penalized_greedy(model, prompts, 0.8, 0.4)
        assert kvtier_greedy(llm, prompts, frequency_penalty=0.8, presence_penalty=0.4) == expected
        assert llm.get_metrics()["vllm:num_preemptions"] > 0
    finally:
        llm.engine.shutdown()
