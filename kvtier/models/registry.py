"""Architecture table: what differs between the supported models, in one place.

The decoder is one class (LFM2 swaps some layers for short convolutions); each architecture only
sets flags, says which layers slide and how its feed-forward size is read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# (hf config dict, num_layers) -> per-layer window (None = full attention). Used only when the
# config has no explicit `layer_types` list (transformers < 5 wrote none).
WindowRule = Callable[[dict[str, Any], int], tuple[int | None, ...]]


def _no_windows(hf: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    return (None,) * num_layers


def _window_on_every_layer(hf: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    return (hf.get("sliding_window"),) * num_layers


def _window_above_max_window_layers(hf: dict[str, Any],
                                    num_layers: int) -> tuple[int | None, ...]:
    # Qwen2/Qwen3: layers from `max_window_layers` on slide, and only with use_sliding_window.
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    first_sliding = hf.get("max_window_layers", num_layers)
    return tuple(window if i >= first_sliding else None for i in range(num_layers))


def _plain_ffn_size(hf: dict[str, Any]) -> int:
    return int(hf["intermediate_size"])


def _lfm2_ffn_size(hf: dict[str, Any]) -> int:
    # LFM2 stores a nominal size and derives the real one: 2/3 of it, times a multiplier,
    # rounded up to a multiple (HF's Lfm2MLP).
    size = int(hf.get("block_ff_dim", hf["intermediate_size"]))
    if not hf.get("block_auto_adjust_ff_dim", True):
        return size
    size = int(2 * size / 3)
    multiplier = hf.get("block_ffn_dim_multiplier", 1.0)
    if multiplier is None:
        return size
    multiple = int(hf.get("block_multiple_of", 256))
    size = int(multiplier * size)
    return multiple * -(-size // multiple)


@dataclass(frozen=True)
class ArchitectureSpec:
    name: str
    hf_classes: tuple[str, ...]
    # q/k/v biases regardless of `attention_bias` (Qwen2 always has them).
    always_qkv_bias: bool
    # `attention_bias` puts a bias on q/k/v and o_proj (Llama, Qwen3). transformers' Qwen2,
    # Mistral and LFM2 ignore the key, and so does kvtier for them.
    reads_attention_bias: bool
    qk_norm: bool
    default_windows: WindowRule
    # `layer_types` may name "conv" layers (gated short convolutions with a recurrent state).
    short_conv: bool = False
    # Feed-forward width from the HF config.
    ffn_size: Callable[[dict[str, Any]], int] = _plain_ffn_size
    # `mlp_bias` puts a bias on gate/up/down (Llama); the others' MLPs never have one.
    reads_mlp_bias: bool = False

    def qkv_bias(self, attention_bias: bool) -> bool:
        """q/k/v carry a bias, given the config's `attention_bias`."""
        return self.always_qkv_bias or (self.reads_attention_bias and attention_bias)

    def o_proj_bias(self, attention_bias: bool) -> bool:
        return self.reads_attention_bias and attention_bias

    def mlp_bias(self, mlp_bias: bool) -> bool:
        return self.reads_mlp_bias and mlp_bias


ARCHITECTURES: dict[str, ArchitectureSpec] = {
    spec.name: spec for spec in (
        ArchitectureSpec("llama", ("LlamaForCausalLM",), always_qkv_bias=False,
                         reads_attention_bias=True, qk_norm=False,
                         default_windows=_no_windows, reads_mlp_bias=True),
        ArchitectureSpec("qwen2", ("Qwen2ForCausalLM",), always_qkv_bias=True,
                         reads_attention_bias=False, qk_norm=False,
                         default_windows=_window_above_max_window_layers),
        ArchitectureSpec("qwen3", ("Qwen3ForCausalLM",), always_qkv_bias=False,
                         reads_attention_bias=True, qk_norm=True,
                         default_windows=_window_above_max_window_layers),
        ArchitectureSpec("mistral", ("MistralForCausalLM",), always_qkv_bias=False,
                         reads_attention_bias=False, qk_norm=False,
                         default_windows=_window_on_every_layer),
        ArchitectureSpec("lfm2", ("Lfm2ForCausalLM",), always_qkv_bias=False,
                         reads_attention_bias=False, qk_norm=True,
                         default_windows=_no_windows, short_conv=True,
                         ffn_size=_lfm2_ffn_size),
    )
}

# HF `architectures[0]` -> spec.
BY_HF_CLASS: dict[str, ArchitectureSpec] = {
    hf_class: spec for spec in ARCHITECTURES.values() for hf_class in spec.hf_classes}

# GGUF `general.architecture` values kvtier reads.
GGUF_ARCHITECTURES: dict[str, ArchitectureSpec] = {"llama": ARCHITECTURES["llama"]}


def find_hf_architecture(hf: dict[str, Any]) -> ArchitectureSpec | None:
    """The spec for an HF config dict: by `architectures`, else by `model_type`."""
    for hf_class in hf.get("architectures") or ():
        if hf_class in BY_HF_CLASS:
            return BY_HF_CLASS[hf_class]
    if hf.get("architectures"):
        return None
    return ARCHITECTURES.get(hf.get("model_type", ""))
