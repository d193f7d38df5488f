"""The packaged SmolLM2-135M-Instruct GGUF loads and answers a factual prompt greedily."""

import pytest
import torch

from kvtier.models import load_model
from kvtier.models.gguf_file import GGUFModelFile
from kvtier.models.gguf_tokenizer import tokenizer_from_gguf
from kvtier.models.loader import default_model_path

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


def test_smollm2_tokenizer_names_its_unk_and_pad_tokens_like_hf():
    """The GGUF's unknown/padding ids are SmolLM2-135M-Instruct's tokenizer_config.json
    unk_token and pad_token; a template printing them renders as transformers renders it."""
    path = default_model_path()
    tokenizer = tokenizer_from_gguf(GGUFModelFile(path).fields, path)
    assert tokenizer.special_tokens == {
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>",
        "pad_token": "<|im_end|>"}
