"""Tiny random-weight HF models (fp32, 2 layers) saved to disk for the tests, small tokenizers for
text prompts, prompt makers, and HF transformers' greedy outputs as the reference."""

from __future__ import annotations

import json
import os
import random

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

VOCAB = 128
BASE_CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                   rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)

# architecture -> (HF config class, HF model class, extra config keys)
ARCHS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 32}),
    # The window (6) is shorter than most test prompts, so old blocks really drop out.
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM,
                {"sliding_window": 6}),
    # Hybrid: layer 0 full attention, layer 1 sliding: two KV cache groups in one block pool.
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}),
}

# The byte-level tokenizer: 256 byte tokens, then these specials.
BYTE_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BYTE_VOCAB = 256 + len(BYTE_SPECIALS)
BYTE_BOS_ID, BYTE_EOS_ID = 256, 258
# The "thinking" tokenizer: the byte one plus a reasoning model's two (non-special) tags.
THINK_TAGS = ("<think>", "</think>")
THINK_START_ID, THINK_END_ID = BYTE_VOCAB, BYTE_VOCAB + 1
BYTE_CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                      "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>"
                      "assistant\n{% endif %}")
WORD_CHAT_TEMPLATE = ("{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> "
                      "{% endfor %}{% if add_generation_prompt %}<s> assistant {% endif %}")

# tokenizer kind -> the model config it needs. A byte per token makes text prompts long.
_TOKENIZER_CONFIG = {
    None: {},
    "words": {},
    "bytes": {"vocab_size": BYTE_VOCAB, "bos_token_id": BYTE_BOS_ID, "eos_token_id": BYTE_EOS_ID,
              "max_position_embeddings": 2048},
    "thinking": {"vocab_size": BYTE_VOCAB + 2, "bos_token_id": BYTE_BOS_ID,
                 "eos_token_id": BYTE_EOS_ID, "max_position_embeddings": 2048},
}


def make_hf_model(arch: str, directory, seed: int = 0, tokenizer: str | None = None,
                  **overrides):
    """Save a tiny random fp32 HF model of `arch` into `directory`; return it in eval mode.

    `tokenizer` also saves one beside it: "words" (save_word_tokenizer), "bytes"
    (save_byte_tokenizer, which sets the vocabulary and BOS/EOS ids to match) or "thinking"
    (the byte tokenizer with THINK_TAGS)."""
    if tokenizer not in _TOKENIZER_CONFIG:
        raise ValueError(f"tokenizer={tokenizer!r}: use None, 'words', 'bytes' or 'thinking'")
    config_cls, model_cls, extra = ARCHS[arch]
    config = config_cls(**{**BASE_CONFIG, **extra, **_TOKENIZER_CONFIG[tokenizer], **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        # Larger-than-default weights so greedy choices are clear-cut, not near-ties.
        for param in model.parameters():
            param.normal_(0.0, 0.2) if param.dim() > 1 else param.uniform_(0.5, 1.5)
    model.save_pretrained(directory)
    if tokenizer == "words":
        save_word_tokenizer(directory)
    elif tokenizer in ("bytes", "thinking"):
        save_byte_tokenizer(directory, THINK_TAGS if tokenizer == "thinking" else ())
    # The engine runs with ignore_eos; else HF's min_new_tokens would mask EOS, which the
    # engine may pick.
    model.generation_config.eos_token_id = None
    return model


def save_word_tokenizer(directory) -> list[str]:
    """A word-level tokenizer over the VOCAB-token model: token i is the word "w{i}" (0-4 are
    <unk>, <s>, </s>, user, assistant); decode joins words with spaces. Returns the vocabulary
    in id order."""
    words = ["<unk>", "<s>", "</s>", "user", "assistant"] + [f"w{i}" for i in range(5, VOCAB)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    _save_tokenizer(directory, tokenizer, {"bos_token": "<s>", "eos_token": "</s>",
                                           "chat_template": WORD_CHAT_TEMPLATE})
    return words


def save_byte_tokenizer(directory, extra_tokens: tuple[str, ...] = ()) -> None:
    """A byte-level BPE tokenizer without merges (one token per byte), BYTE_SPECIALS after the
    bytes, then `extra_tokens` (added, not special), and an im_start/im_end chat template; the
    model needs BYTE_VOCAB tokens and one per extra token."""
    vocab = {symbol: i for i, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(BYTE_SPECIALS))
    tokenizer.add_tokens(list(extra_tokens))
    _save_tokenizer(directory, tokenizer, {"bos_token": None, "eos_token": BYTE_SPECIALS[2],
                                           "chat_template": BYTE_CHAT_TEMPLATE})


def _save_tokenizer(directory, tokenizer: Tokenizer, config: dict) -> None:
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """HF's greedy continuation of each prompt, exactly max_new_tokens long."""
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            generated = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                                       min_new_tokens=max_new_tokens, do_sample=False,
                                       pad_token_id=0)
            outputs.append(generated[0, len(prompt):].tolist())
    return outputs


def hf_greedy_rounded_kv(model, prompts: list[list[int]], max_new_tokens: int,
                         fmt: torch.dtype) -> list[list[int]]:
    """hf_greedy with every attention layer's K and V rounded to the fp8 format `fmt` (and
    saturated) before attending, as kvtier's --kv-cache-dtype stores them. HF's own cache may
    keep them unrounded: rounding twice is rounding once."""
    name = f"kvtier_rounded_{str(fmt).removeprefix('torch.')}"
    limit = torch.finfo(fmt).max

    def attend(module, query, key, value, attention_mask, **kwargs):
        key = key.clamp(-limit, limit).to(fmt).to(key.dtype)
        value = value.clamp(-limit, limit).to(fmt).to(value.dtype)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(name, attend)
    AttentionMaskInterface.register(name, sdpa_mask)  # SDPA's masks, sliding windows included
    model.set_attn_implementation(name)
    try:
        return hf_greedy(model, prompts, max_new_tokens)
    finally:
        model.set_attn_implementation("sdpa")


def _random_tokens(rng: random.Random, n: int) -> list[int]:
    # Ids 0-2 are pad/BOS/EOS.
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def random_prompts(num: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [_random_tokens(rng, length) for _ in range(num)]


def make_prompts(seed: int = 0) -> list[list[int]]:
    """Seven lengths; four share a 12-token prefix (prefix-cache hits within a batch)."""
    rng = random.Random(seed)
    shared = _random_tokens(rng, 12)
    return [shared + _random_tokens(rng, 5), _random_tokens(rng, 3),
            shared + _random_tokens(rng, 21), _random_tokens(rng, 33), shared,
            _random_tokens(rng, 9), shared + _random_tokens(rng, 14)]


def make_block_prompts(seed: int = 0) -> list[list[int]]:
    """Lengths 19, 16, 13, 23, 6: on and off boundaries of 4-token blocks; the first and third
    share their first 3 blocks; the last has a single full block before its last token."""
    rng = random.Random(seed)
    shared = _random_tokens(rng, 12)
    return [shared + _random_tokens(rng, 7), _random_tokens(rng, 16),
            shared + _random_tokens(rng, 1), _random_tokens(rng, 23), _random_tokens(rng, 6)]


# LFM2 hybrids (short convolutions + attention), by name: the layer mix, then config overrides.
# "auto_ffn" keeps HF's derived feed-forward width (2/3 of 96, rounded up to 32) and conv biases.
LFM2_MIXES = {
    "conv_attn": (["conv", "full_attention"], {}),
    "attn_conv_conv": (["full_attention", "conv", "conv"], {"conv_L_cache": 4}),
    "auto_ffn": (["conv", "conv", "full_attention", "conv"],
                 {"block_auto_adjust_ff_dim": True, "block_multiple_of": 32, "conv_bias": True}),
}


def make_lfm2_model(mix: str, directory, seed: int = 0, **overrides):
    """Save a tiny random fp32 LFM2 (`LFM2_MIXES[mix]`) into `directory`; return it in eval
    mode, as make_hf_model does for the other architectures."""
    layer_types, extra = LFM2_MIXES[mix]
    base = {key: value for key, value in BASE_CONFIG.items() if key != "rms_norm_eps"}
    config = transformers.Lfm2Config(**{
        **base, "norm_eps": 1e-5, "num_hidden_layers": len(layer_types),
        "layer_types": layer_types, "block_auto_adjust_ff_dim": False, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.Lfm2ForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2) if param.dim() > 1 else param.uniform_(0.5, 1.5)
    model.save_pretrained(directory)
    model.generation_config.eos_token_id = None
    return model
