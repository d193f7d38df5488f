"""The packaged SmolLM2-135M-Instruct GGUF loads and answers a factual prompt greedily."""

import pytest
import torch

from kvtier.models import load_model

from .helpers import PagedDriver


@pytest.mark.slow  # ~15 s to dequantize 135M weights on a shared CPU, plus the decode steps
def test_smollm2_greedy_completes_paris():
    loaded = load_model(None, dtype=torch.float32)
    assert (loaded.config.num_layers, loaded.config.num_heads, loaded.config.num_kv_heads,
            loaded.config.tie_word_embeddings) == (30, 9, 3, True)
    tokenizer = loaded.tokenizer
    driver = PagedDriver(loaded.model)
    logits = driver.step({0: tokenizer.encode("The capital of France is")})[0]
    generated = []
    for _ in range(4):
        generated.append(int(logits[-1].argmax()))
        logits = driver.step({0: generated[-1:]})[0]
    assert "Paris" in tokenizer.decode(generated)
