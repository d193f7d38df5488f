"""Read a llama-architecture GGUF file: metadata -> ModelConfig, tensors -> HF-named weights.

Quantized tensors (Q4_1, Q8_0, ...) are dequantized with `gguf.quants`. llama.cpp's converter
permutes the rows of q/k projections into its interleaved RoPE layout; `_unpermute` restores HF's
rotate-half layout so the same decoder runs both formats.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from kvtier.models.config import ModelConfig
from kvtier.models.errors import ModelLoadError
from kvtier.models.registry import GGUF_ARCHITECTURES

_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                   "output": "lm_head"}
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def _unpermute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    rows = weight.shape[0]
    # llama.cpp stored (heads, half, 2, ...) interleaved pairs; HF wants (heads, 2, half, ...).
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))


def hf_tensor_name(gguf_name: str) -> str | None:
    """HF parameter name of a GGUF tensor, or None if the decoder has no such parameter."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
    match = _BLOCK_NAME.match(gguf_name)
    if match is None or match.group(2) not in _BLOCK_TENSORS:
        return None
    layer, part, suffix = match.groups()
    return f"model.layers.{layer}.{_BLOCK_TENSORS[part]}.{suffix}"


class GGUFModelFile:
    """One opened GGUF file. Raises ModelLoadError naming the file on any defect."""

    def __init__(self, path: str) -> None:
        import gguf  # heavy; only GGUF loads need it

        self.path = path
        try:
            self.reader = gguf.GGUFReader(path)
            self.fields: dict[str, Any] = {
                key: field.contents() for key, field in self.reader.fields.items()}
        except FileNotFoundError as exc:
            raise ModelLoadError(path, "file not found") from exc
        except (ValueError, IndexError, KeyError, OSError, TypeError) as exc:
            raise ModelLoadError(path, f"corrupt or truncated GGUF file ({exc})") from exc

    def _arch_value(self, key: str, default: Any = None) -> Any:
        arch = self.fields["general.architecture"]
        value = self.fields.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(self.path, f"missing metadata key {arch}.{key}")
        return value

    def model_config(self, name: str) -> ModelConfig:
        arch = self.fields.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ModelLoadError(self.path, f"unsupported GGUF architecture {arch!r}; kvtier "
                                            f"reads {', '.join(GGUF_ARCHITECTURES)}")
        names = {t.name for t in self.reader.tensors}
        if "rope_freqs.weight" in names:
            raise ModelLoadError(self.path, "rope_freqs (GGUF llama3 RoPE scaling) is not "
                                            "supported; load the HF directory instead")
        self._refuse_rope_scaling(arch)
        hidden = self._arch_value("embedding_length")
        num_heads = self._arch_value("attention.head_count")
        head_dim = self._arch_value("attention.key_length", hidden // num_heads)
        if self._arch_value("rope.dimension_count", head_dim) != head_dim:
            raise ModelLoadError(self.path, "partial rotary (rope.dimension_count != head_dim) "
                                            "is not supported")
        num_layers = self._arch_value("block_count")
        return ModelConfig(
            architecture=GGUF_ARCHITECTURES[arch].name,
            vocab_size=int(self._arch_value(
                "vocab_size", len(self.fields.get("tokenizer.ggml.tokens", ())) or None)),
            hidden_size=int(hidden), intermediate_size=int(self._arch_value("feed_forward_length")),
            num_layers=int(num_layers), num_heads=int(num_heads),
            num_kv_heads=int(self._arch_value("attention.head_count_kv", num_heads)),
            head_dim=int(head_dim), rope_theta=float(self._arch_value("rope.freq_base", 10000.0)),
            rope_scaling=None,
            rms_norm_eps=float(self._arch_value("attention.layer_norm_rms_epsilon")),
            max_position_embeddings=int(self._arch_value("context_length")),
            sliding_window=None, layer_sliding_windows=(None,) * int(num_layers),
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            o_proj_bias="blk.0.attn_output.bias" in names,
            mlp_bias="blk.0.ffn_up.bias" in names, qk_norm=False,
            bos_token_id=self.fields.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=self.end_token_ids(), name=name)

    def _refuse_rope_scaling(self, arch: str) -> None:
        """kvtier runs GGUF models with plain RoPE, so it refuses the scaling llama.cpp would
        apply: any `rope.scaling.type` but "none", or, with no type, a factor other than 1
        (llama.cpp then scales linearly; `rope.scale_linear` is that factor's old name)."""
        type_key = f"{arch}.rope.scaling.type"
        rope_type = self.fields.get(type_key)
        if rope_type == "none":
            return
        if rope_type is not None:
            raise ModelLoadError(self.path, f"invalid value: {type_key} must be absent or "
                                            f"'none' (plain RoPE), got {rope_type!r}; kvtier "
                                            "does not implement GGUF RoPE scaling")
        for factor_key in (f"{arch}.rope.scaling.factor", f"{arch}.rope.scale_linear"):
            factor = self.fields.get(factor_key)
            if factor not in (None, 0.0, 1.0):
                raise ModelLoadError(self.path, f"invalid value: {factor_key} {factor!r} "
                                                f"without {type_key} means linear RoPE "
                                                "scaling, which kvtier does not implement "
                                                "for GGUF")

    def end_token_ids(self) -> tuple[int, ...]:
        """End-of-sequence ids: eos, plus the end-of-turn token chat models stop on."""
        ids = (self.fields.get("tokenizer.ggml.eos_token_id"),
               self.fields.get("tokenizer.ggml.eot_token_id"))
        return tuple(dict.fromkeys(int(i) for i in ids if i is not None))

    def iter_weights(self, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, fp32 tensor) per tensor, dequantized and with q/k rows un-permuted."""
        from gguf.quants import dequantize

        for tensor in self.reader.tensors:
            hf_name = hf_tensor_name(tensor.name)
            if hf_name is None:
                raise ModelLoadError(self.path, f"unexpected tensor {tensor.name!r}")
            try:
                array = dequantize(tensor.data, tensor.tensor_type)
            except (NotImplementedError, ValueError) as exc:
                raise ModelLoadError(self.path, f"cannot dequantize {tensor.name!r} "
                                                f"({tensor.tensor_type.name}): {exc}") from exc
            # GGUF lists dims fastest-first; torch wants them slowest-first.
            shape = tuple(int(d) for d in reversed(tensor.shape))
            # F32 tensors come back as read-only views of the mapped file: copy those.
            array = np.require(array, dtype=np.float32, requirements=("C", "W"))
            weight = torch.from_numpy(array).reshape(shape)
            if ".q_proj." in hf_name:
                weight = _unpermute(weight, config.num_heads)
            elif ".k_proj." in hf_name:
                weight = _unpermute(weight, config.num_kv_heads)
            yield hf_name, weight
