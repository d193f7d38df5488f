"""Tiny random-weight models on disk and their HF greedy outputs (the e2e tests' reference)."""

from __future__ import annotations

import random

import torch
import transformers

VOCAB = 128
_SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def make_tiny_llama(directory, seed: int = 0) -> transformers.LlamaForCausalLM:
    return _save(transformers.LlamaForCausalLM(transformers.LlamaConfig(**_SHAPE)), directory,
                 seed)


def make_tiny_mistral(directory, sliding_window: int,
                      seed: int = 0) -> transformers.MistralForCausalLM:
    config = transformers.MistralConfig(**_SHAPE, sliding_window=sliding_window)
    return _save(transformers.MistralForCausalLM(config), directory, seed)


def _save(model, directory, seed: int):
    torch.manual_seed(seed)
    model = model.eval()
    with torch.no_grad():
        # Larger-than-default weights: greedy choices are clear-cut, not near-ties.
        for param in model.parameters():
            param.normal_(0.0, 0.2) if param.dim() > 1 else param.uniform_(0.5, 1.5)
    model.save_pretrained(directory)
    # The engine runs with ignore_eos: HF must not mask or stop at EOS either.
    model.generation_config.eos_token_id = None
    return model


def random_prompts(num: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(length)] for _ in range(num)]


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()
