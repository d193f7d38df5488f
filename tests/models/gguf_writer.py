"""Write an HF Llama checkpoint as a tiny F32 GGUF file, laid out the way llama.cpp's converter
lays it out (q/k rows permuted for its RoPE), with a small byte-level BPE tokenizer."""

from __future__ import annotations

import gguf
import numpy as np
import torch

SPECIAL_TOKENS = ["<s>", "</s>"]
# An arbitrary second end token, to check that eos and eot are both stop ids.
EOT_TOKEN_ID = 258
MERGED_TOKENS = ["he", "ll", "hell", "hello"]
MERGES = ["h e", "l l", "he ll", "hell o"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each byte value, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def tokens() -> list[str]:
    return SPECIAL_TOKENS + byte_alphabet() + MERGED_TOKENS


def _permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    # llama.cpp: rows (heads, 2, half) -> (heads, half, 2), pairing each rotate-half partner.
    rows = weight.shape[0]
    return (weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _tensor_name(hf_name: str) -> str:
    parts = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    name = hf_name.replace("model.layers.", "blk.")
    for hf_part, gguf_part in parts.items():
        name = name.replace(hf_part, gguf_part)
    return name


def _write_metadata(writer: gguf.GGUFWriter, config) -> None:
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens())
    writer.add_token_types([3] * len(SPECIAL_TOKENS) + [1] * (len(tokens()) - 2))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_eot_token_id(EOT_TOKEN_ID)
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHAT_TEMPLATE)


def write_gguf(hf_model, path: str, extra_metadata: dict[str, str | float] | None = None) -> None:
    """`extra_metadata`: more keys ("{arch}" is filled in), strings and float32 numbers."""
    config = hf_model.config
    writer = gguf.GGUFWriter(path, "llama")
    _write_metadata(writer, config)
    for key, value in (extra_metadata or {}).items():
        add = writer.add_string if isinstance(value, str) else writer.add_float32
        add(key.format(arch="llama"), value)
    for hf_name, tensor in hf_model.state_dict().items():
        array = tensor.to(torch.float32).numpy()
        if ".q_proj." in hf_name:
            array = _permute(array, config.num_attention_heads)
        elif ".k_proj." in hf_name:
            array = _permute(array, config.num_key_value_heads)
        writer.add_tensor(_tensor_name(hf_name), np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
