"""LFM2 (Liquid AI): the Llama decoder with q/k RMSNorm, where the layers `layer_types` calls
"conv" hold a gated short convolution (`short_conv.py`) instead of attention.

The HF checkpoint names differ from Llama's only in spelling, so `hf_renames` maps them onto the
shared modules; the attention layers are Llama's DecoderLayer as they are.
"""

from __future__ import annotations

import torch
from torch import nn

from kvtier.models.attention_metadata import AttentionMetadata
from kvtier.models.config import ModelConfig
from kvtier.models.llama import MLP, DecoderLayer, LlamaForCausalLM, RMSNorm
from kvtier.models.short_conv import ShortConv


class ShortConvDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.conv = ShortConv(config.hidden_size, config.conv_kernel_size, config.conv_bias,
                              config.layer_names[layer_index],
                              config.layer_group_ids[layer_index], dtype)
        self.mlp = MLP(config, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                state_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        # cos, sin: unused; the decoder hands every layer the same arguments.
        hidden = hidden + self.conv(self.input_layernorm(hidden), state_cache, metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Lfm2ForCausalLM(LlamaForCausalLM):
    hf_renames = (
        ("self_attn.out_proj.", "self_attn.o_proj."),
        ("self_attn.q_layernorm.", "self_attn.q_norm."),
        ("self_attn.k_layernorm.", "self_attn.k_norm."),
        ("feed_forward.w1.", "mlp.gate_proj."),
        ("feed_forward.w3.", "mlp.up_proj."),
        ("feed_forward.w2.", "mlp.down_proj."),
        (".operator_norm.", ".input_layernorm."),
        (".ffn_norm.", ".post_attention_layernorm."),
        ("model.embedding_norm.", "model.norm."),
        (".conv.conv.weight", ".conv.conv_weight"),
        (".conv.conv.bias", ".conv.conv_bias"),
    )

    @staticmethod
    def make_layer(config: ModelConfig, index: int, dtype: torch.dtype) -> nn.Module:
        if index in config.conv_layer_indices:
            return ShortConvDecoderLayer(config, index, dtype)
        return DecoderLayer(config, index, dtype)
