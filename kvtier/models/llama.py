"""One decoder for the Llama family (Llama, Qwen2, Qwen3, Mistral); the differences are
ModelConfig flags: q/k/v and o_proj biases, q/k RMSNorm, per-layer sliding windows. LFM2
(`lfm2.py`) reuses it with some layers swapped for short convolutions.

Parameter names follow HF's LlamaForCausalLM except that q/k/v and gate/up are fused into
`qkv_proj` and `gate_up_proj` (one matmul each instead of three / two); `load_weights` maps HF
names onto the fused parameters (after a subclass's `hf_renames`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kvtier.models.attention import AttentionMetadata, paged_attention, write_kv
from kvtier.models.config import KVCacheGroupLayout, ModelConfig
from kvtier.models.errors import ModelLoadError
from kvtier.models.fused_ops import rms_norm, rotary, silu_and_mul
from kvtier.models.packed_linear import PackedLinear, can_pack, pack_linears
from kvtier.models.rope import RotaryEmbedding

# Fused parameter name part -> the HF name parts of its pieces, in row order.
_FUSED_PIECES = {".qkv_proj.": (".q_proj.", ".k_proj.", ".v_proj."),
                 ".gate_up_proj.": (".gate_proj.", ".up_proj.")}


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.split_sizes = [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                            self.num_kv_heads * self.head_dim]
        self.qkv_proj = nn.Linear(config.hidden_size, sum(self.split_sizes),
                                  bias=config.attention_bias, dtype=dtype)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size,
                                bias=config.o_proj_bias, dtype=dtype)
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        self.layer_name = config.layer_names[layer_index]
        self.group_id = config.layer_group_ids[layer_index]
        self.sliding_window = config.layer_sliding_windows[layer_index]
        self.scale = self.head_dim ** -0.5

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split(self.split_sizes, dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)  # (T, Hq, D)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        hooks = metadata.layer_hooks
        if hooks is not None:
            hooks.wait_for_layer_load(self.layer_name)
        write_kv(kv_cache, k, v, metadata.slot_mapping[self.group_id])
        out = paged_attention(q, kv_cache, metadata, self.group_id, self.scale,
                              self.sliding_window)
        if hooks is not None:
            hooks.save_kv_layer(self.layer_name, kv_cache, metadata)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size,
                                      bias=config.mlp_bias, dtype=dtype)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size,
                                   bias=config.mlp_bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_index, dtype)
        self.mlp = MLP(config, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache,
                                         metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DecoderStack(nn.Module):
    """HF's `model.` prefix: embeddings, layers (`make_layer(config, index, dtype)`), final
    norm."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype,
                 make_layer: Callable[[ModelConfig, int, torch.dtype], nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(make_layer(config, i, dtype)
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class LlamaForCausalLM(nn.Module):
    """forward(input_ids, positions, kv_caches, metadata) -> hidden; compute_logits(hidden)."""

    # (HF name part, our name part), replaced in every HF tensor name before the fusing.
    hf_renames: tuple[tuple[str, str], ...] = ()

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderStack(config, dtype, self.make_layer)
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False,
                                     dtype=dtype)
        # Set by pack_weights: the logits head packed for oneDNN (tied or not).
        self.logits_head: PackedLinear | None = None
        # Built on the real device even when the parameters start on "meta".
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling,
                                      device)
        self.layer_group_ids: list[int] = list(config.layer_group_ids)

    @staticmethod
    def make_layer(config: ModelConfig, index: int, dtype: torch.dtype) -> nn.Module:
        return DecoderLayer(config, index, dtype)

    def kv_cache_groups(self) -> tuple[KVCacheGroupLayout, ...]:
        """One entry per KV cache group (the runner turns them into kvtier.kv specs)."""
        return self.config.kv_cache_groups()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], metadata: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: (T,); kv_caches: one paged tensor per layer -> (T, hidden)."""
        hidden = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden = layer(hidden, cos, sin, kv_cache, metadata)
        return self.model.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> fp32 (N, vocab)."""
        if self.logits_head is not None:
            return self.logits_head(hidden).float()
        return F.linear(hidden, self._head_weight()).float()

    def _head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def pack_weights(self) -> None:
        """Pack the projections and the logits head for oneDNN where `can_pack` allows (bf16 on
        CPU). Call after load_weights: packed matrices are no longer parameters."""
        pack_linears(self.model)
        head = self._head_weight()
        if can_pack(head):
            self.logits_head = PackedLinear(head, None)
            self.lm_head = None  # an untied head's plain copy; a tied one stays the embeddings

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
        """Copy HF-named tensors into the parameters; every piece of every parameter must be
        given exactly once, as a floating-point tensor of the right shape.

        `source` names the file(s) in error messages.
        """
        params = dict(self.named_parameters())
        # HF-style tensor name -> (parameter name, index of its rows within the parameter).
        owners = {piece: (name, index) for name in params
                  for index, piece in enumerate(_pieces(name))}
        pending = set(owners)
        for hf_name, tensor in weights:
            piece = hf_name
            for part, ours in self.hf_renames:
                piece = piece.replace(part, ours)
            if piece not in owners:
                if hf_name == "lm_head.weight" and self.lm_head is None:
                    continue  # Tied: some checkpoints still store a copy of the embeddings.
                raise ModelLoadError(source, f"unexpected tensor {hf_name!r}"
                                             f"{_bias_hint([hf_name])}")
            if piece not in pending:
                raise ModelLoadError(source, f"tensor {hf_name!r} appears more than once")
            name, index = owners[piece]
            target = _piece_view(params[name], name, index, self.config)
            _check_tensor(tensor, target, hf_name, source)
            with torch.no_grad():
                target.copy_(tensor)
            pending.discard(piece)
        if pending:
            raise ModelLoadError(source, f"missing tensors: {', '.join(sorted(pending))}"
                                         f"{_bias_hint(pending)}")


def _pieces(name: str) -> tuple[str, ...]:
    """The HF-style names of the tensors that fill parameter `name`, in row order."""
    for fused_part, parts in _FUSED_PIECES.items():
        if fused_part in name:
            return tuple(name.replace(fused_part, part) for part in parts)
    return (name,)


def _bias_hint(names: Iterable[str]) -> str:
    if not any(name.endswith(".bias") for name in names):
        return ""
    return ("; the model has the biases its architecture and config give it (config.json's "
            "attention_bias and mlp_bias, as transformers reads them), and the checkpoint's "
            "bias tensors must match")


def _check_tensor(tensor: torch.Tensor, target: torch.Tensor, hf_name: str, source: str) -> None:
    # copy_ would cast integer (quantized) or float8 (scaled) values without their scales.
    if not tensor.is_floating_point() or tensor.element_size() == 1:
        raise ModelLoadError(source, f"tensor {hf_name!r} has dtype {tensor.dtype}; kvtier "
                                     "loads only fp32/fp16/bf16 weights")
    if tuple(tensor.shape) != tuple(target.shape):
        raise ModelLoadError(source, f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(target.shape)}")


def _piece_view(param: torch.Tensor, name: str, index: int,
                config: ModelConfig) -> torch.Tensor:
    """The rows of parameter `name` that its piece `index` fills (all of them if unfused)."""
    if ".qkv_proj." in name:
        q_rows = config.num_heads * config.head_dim
        kv_rows = config.num_kv_heads * config.head_dim
        sizes = [q_rows, kv_rows, kv_rows]
    elif ".gate_up_proj." in name:
        sizes = [config.intermediate_size] * 2
    else:
        return param
    return param.narrow(0, sum(sizes[:index]), sizes[index])
