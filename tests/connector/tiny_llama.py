"""A tiny random-weight Llama saved to disk, prompts that fill several blocks, HF's outputs."""

from __future__ import annotations

import random

import torch
import transformers

VOCAB = 128
BLOCK_SIZE = 4
MAX_TOKENS = 6


def make_tiny_llama(directory, seed: int = 0) -> transformers.LlamaForCausalLM:
    """Save a 2-layer fp32 Llama into `directory`; return it in eval mode."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        # Larger-than-default weights so greedy choices are clear-cut, not near-ties.
        for param in model.parameters():
            param.normal_(0.0, 0.2) if param.dim() > 1 else param.uniform_(0.5, 1.5)
    model.save_pretrained(directory)
    # Else HF's min_new_tokens would mask EOS, which the engine (ignore_eos) may pick.
    model.generation_config.eos_token_id = None
    return model


def make_prompts(seed: int = 0) -> list[list[int]]:
    """Lengths on and off block boundaries (block size 4); two share their first 3 blocks;
    the last has a single full block before its last token."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    shared = tokens(12)
    return [shared + tokens(7), tokens(16), shared + tokens(1), tokens(23), tokens(6)]


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int = MAX_TOKENS) -> list[list[int]]:
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            generated = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                                       min_new_tokens=max_new_tokens, do_sample=False,
                                       pad_token_id=0)
            outputs.append(generated[0, len(prompt):].tolist())
    return outputs
