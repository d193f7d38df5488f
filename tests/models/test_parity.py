"""Our decoder over the paged cache gives HF transformers' fp32 logits, for every architecture."""

import copy
import random

import torch

from kvtier.models import load_model

from ..tiny_models import VOCAB
from .helpers import PagedDriver, hf_logits

ATOL = 1e-4


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(length)]


def test_full_prefill_matches_hf(model_pair):
    hf_model, loaded = model_pair
    prompt = _prompt(13, seed=1)
    ours = PagedDriver(loaded.model, seed=3).step({0: prompt})[0]
    torch.testing.assert_close(ours, hf_logits(hf_model, prompt), atol=ATOL, rtol=0)


def test_chunked_prefill_over_cached_prefix_matches_hf(model_pair):
    hf_model, loaded = model_pair
    prompt = _prompt(14, seed=2)
    driver = PagedDriver(loaded.model, seed=4)
    chunks = [driver.step({0: prompt[a:b]})[0] for a, b in ((0, 5), (5, 9), (9, 14))]
    torch.testing.assert_close(torch.cat(chunks), hf_logits(hf_model, prompt), atol=ATOL, rtol=0)


def test_batched_greedy_decode_matches_hf(model_pair):
    hf_model, loaded = model_pair
    prompts = {0: _prompt(3, seed=5), 1: _prompt(9, seed=6), 2: _prompt(14, seed=7)}
    driver = PagedDriver(loaded.model, seed=5)
    # Step 1 prefills seqs 0 and 1 together; seq 2 joins at step 2 while the others decode.
    logits = driver.step({0: prompts[0], 1: prompts[1]})
    sequences = {s: list(prompts[s]) for s in prompts}
    for step in range(5):
        if step == 1:
            logits.update(driver.step({2: prompts[2]}))
        for seq, seq_logits in logits.items():
            torch.testing.assert_close(seq_logits[-1], hf_logits(hf_model, sequences[seq])[-1],
                                       atol=ATOL, rtol=0)
            sequences[seq].append(int(seq_logits[-1].argmax()))
        logits = driver.step({seq: sequences[seq][-1:] for seq in logits})
    with torch.no_grad():
        expected = hf_model.generate(torch.tensor([prompts[1]]), max_new_tokens=5,
                                     do_sample=False, eos_token_id=None, pad_token_id=0)
    assert sequences[1] == expected[0].tolist()


def test_sliding_window_is_shorter_than_the_prompt(model_pair):
    _, loaded = model_pair
    windows = [w for w in loaded.config.layer_sliding_windows if w is not None]
    expected = {"llama": [], "qwen2": [5], "qwen3": [], "mistral": [6, 6]}
    assert windows == expected[loaded.config.architecture]
    assert all(w < 13 for w in windows)


def test_bf16_is_as_close_to_fp32_as_hf_bf16(model_pair, tmp_path):
    hf_model, _ = model_pair
    hf_model.save_pretrained(tmp_path)
    bf16 = load_model(str(tmp_path), dtype=torch.bfloat16)
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
    prompt = _prompt(12, seed=8)
    ours = PagedDriver(bf16.model).step({0: prompt})[0]
    assert ours.dtype == torch.float32
    exact = hf_logits(hf_model, prompt)
    hf_bf16_error = (hf_logits(copy.deepcopy(hf_model).bfloat16(), prompt) - exact).abs().max()
    assert (ours - exact).abs().max() <= 1.5 * hf_bf16_error + 0.02
