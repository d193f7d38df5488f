"""A tiny random-weight Llama (fp32) with a byte-level tokenizer and a chat template."""

from __future__ import annotations

import json
import os

import torch
import transformers
from tokenizers import Tokenizer, decoders, models
from tokenizers.pre_tokenizers import ByteLevel

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# 256 byte tokens, then the specials.
VOCAB = 256 + len(SPECIALS)
BOS_ID, EOS_ID = 256, 258
MAX_POSITIONS = 2048
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")


def _save_tokenizer(directory: str) -> None:
    vocab = {symbol: i for i, symbol in enumerate(sorted(ByteLevel.alphabet()))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIALS))
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": None, "eos_token": SPECIALS[2], "chat_template": CHAT_TEMPLATE},
                  f)


def make_tiny_model(directory: str, seed: int = 0) -> transformers.LlamaForCausalLM:
    """Save the model and tokenizer into `directory`; return the HF model (eval, fp32)."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5, bos_token_id=BOS_ID, eos_token_id=EOS_ID, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        # Larger-than-default weights so greedy choices are clear-cut, not near-ties.
        for param in model.parameters():
            param.normal_(0.0, 0.2) if param.dim() > 1 else param.uniform_(0.5, 1.5)
    model.save_pretrained(directory)
    _save_tokenizer(directory)
    return model


def hf_greedy(model: transformers.LlamaForCausalLM, prompt: list[int],
              max_new_tokens: int) -> list[int]:
    """Greedy continuation ignoring EOS (the server side sets ignore_eos)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                             eos_token_id=None)
    return out[0, len(prompt):].tolist()
