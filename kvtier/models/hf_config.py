"""Parse an HF config.json into a ModelConfig."""

from __future__ import annotations

import json
import os
from typing import Any

from kvtier.models.config import ModelConfig
from kvtier.models.errors import ModelLoadError
from kvtier.models.registry import ARCHITECTURES, ArchitectureSpec, find_hf_architecture

_LAYER_TYPE_FULL = "full_attention"
_LAYER_TYPE_SLIDING = "sliding_attention"
_LAYER_TYPE_CONV = "conv"
# hidden_act values that name the SiLU the decoder's MLP applies (LFM2 configs name none).
_SILU_NAMES = ("silu", "swish")


def read_json(path: str) -> dict[str, Any]:
    """A JSON object from `path`; ModelLoadError if missing or not a JSON object."""
    if not os.path.isfile(path):
        raise ModelLoadError(path, "file not found")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(path, f"not readable JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(path, "expected a JSON object at the top level")
    return data


def parse_rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either transformers 5's `rope_parameters` or the older
    `rope_theta` + `rope_scaling` keys. Plain RoPE gives scaling None."""
    params = dict(hf.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = params or hf.get("rope_scaling") or None
    if scaling is None:
        return theta, None
    scaling = dict(scaling)
    # A factor of 1 rotates every dimension, as without one (_refuse_partial_rotary refuses
    # any other).
    scaling.pop("partial_rotary_factor", None)
    # Older configs say "type" where newer ones say "rope_type".
    rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
    if rope_type == "default":
        return theta, None
    return theta, {"rope_type": rope_type, **scaling}


def _layer_kinds(hf: dict[str, Any], spec: ArchitectureSpec, num_layers: int,
                 path: str) -> tuple[tuple[int | None, ...], tuple[int, ...]]:
    """(per-layer window, None for full attention; indices of the short-conv layers)."""
    layer_types = hf.get("layer_types")
    if layer_types is None and spec.short_conv:
        # LFM2 configs written before `layer_types` list the attention layers instead.
        attention = hf.get("full_attn_idxs")
        attention = range(num_layers) if attention is None else set(attention)
        layer_types = [_LAYER_TYPE_FULL if i in attention else _LAYER_TYPE_CONV
                       for i in range(num_layers)]
    if layer_types is None:
        return spec.default_windows(hf, num_layers), ()
    window = hf.get("sliding_window")
    windows: list[int | None] = []
    conv: list[int] = []
    for index, kind in enumerate(layer_types):
        if kind == _LAYER_TYPE_FULL:
            windows.append(None)
        elif kind == _LAYER_TYPE_SLIDING and window is not None:
            windows.append(int(window))
        elif kind == _LAYER_TYPE_CONV and spec.short_conv:
            windows.append(None)
            conv.append(index)
        else:
            raise ModelLoadError(path, f"layer_types entry {kind!r} is not supported "
                                       f"(sliding_window={window!r})")
    return tuple(windows), tuple(conv)


def _refuse_unsupported(hf: dict[str, Any], path: str) -> None:
    """Settings the decoder would otherwise ignore, running with the wrong maths."""
    quantization = hf.get("quantization_config")
    if quantization is not None:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        raise ModelLoadError(path, f"quantization_config (quant_method {method!r}): quantized "
                                   "checkpoints are not supported; use an unquantised checkpoint "
                                   "or a GGUF file (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, "
                                   "Q8_0, K- and IQ-quants)")
    activation = hf.get("hidden_act", "silu")
    if activation not in _SILU_NAMES:
        raise ModelLoadError(path, f"hidden_act {activation!r} is not supported; the decoder's "
                                   "MLP applies silu")
    _refuse_partial_rotary(hf, path)


def _refuse_partial_rotary(hf: dict[str, Any], path: str) -> None:
    # transformers 5 keeps the factor in rope_parameters; older configs beside the other keys.
    factor = next((source["partial_rotary_factor"]
                   for source in (hf.get("rope_parameters"), hf.get("rope_scaling"), hf)
                   if isinstance(source, dict) and "partial_rotary_factor" in source), None)
    if factor is None or (factor == 1 and not isinstance(factor, bool)):
        return
    # transformers' Llama-family classes are no reference either: their default RoPE ignores
    # the factor and their llama3 RoPE fails on it.
    raise ModelLoadError(path, f"partial_rotary_factor {factor!r} is not supported: kvtier "
                               "applies RoPE to every dimension of each head; if the checkpoint "
                               "was trained with full RoPE, delete the key, else kvtier cannot "
                               "run it")


def _flag(hf: dict[str, Any], key: str, path: str) -> bool:
    """A boolean config key (absent or null: false); a string such as "false" is refused
    rather than read as true."""
    value = hf.get(key)
    if value is not None and not isinstance(value, bool):
        raise ModelLoadError(path, f"{key} must be true or false, got {value!r}")
    return bool(value)


def _bias_flags(hf: dict[str, Any], spec: ArchitectureSpec, path: str) -> dict[str, bool]:
    """ModelConfig's bias flags, from the keys the architecture reads as transformers does."""
    attention_bias = _flag(hf, "attention_bias", path)
    return {"attention_bias": spec.qkv_bias(attention_bias),
            "o_proj_bias": spec.o_proj_bias(attention_bias),
            "mlp_bias": spec.mlp_bias(_flag(hf, "mlp_bias", path))}


def _token_id(value: Any, key: str, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ModelLoadError(path, f"{key}: {value!r} is not a token id (an integer >= 0); "
                                   "write the id the tokenizer gives the token, not its text")
    return value


def _special_ids(hf: dict[str, Any], path: str) -> dict[str, Any]:
    """bos_token_id and eos_token_ids (one id or a list in config.json)."""
    bos = hf.get("bos_token_id")
    eos = hf.get("eos_token_id")
    eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
    return {"bos_token_id": None if bos is None else _token_id(bos, "bos_token_id", path),
            "eos_token_ids": tuple(_token_id(i, "eos_token_id", path) for i in eos)}


def parse_hf_config(model_dir: str, name: str) -> ModelConfig:
    """ModelConfig from `model_dir/config.json`. Raises ModelLoadError naming the file."""
    path = os.path.join(model_dir, "config.json")
    hf = read_json(path)
    spec = find_hf_architecture(hf)
    if spec is None:
        known = ", ".join(c for s in ARCHITECTURES.values() for c in s.hf_classes)
        raise ModelLoadError(path, f"unsupported architecture {hf.get('architectures')!r} "
                                   f"(model_type {hf.get('model_type')!r}); kvtier runs {known}")
    _refuse_unsupported(hf, path)
    try:
        num_layers = int(hf["num_hidden_layers"])
        num_heads = int(hf["num_attention_heads"])
        hidden_size = int(hf["hidden_size"])
        windows, conv_layers = _layer_kinds(hf, spec, num_layers, path)
        rope_theta, rope_scaling = parse_rope(hf)
        return ModelConfig(
            architecture=spec.name, vocab_size=int(hf["vocab_size"]), hidden_size=hidden_size,
            intermediate_size=spec.ffn_size(hf), num_layers=num_layers,
            num_heads=num_heads, num_kv_heads=int(hf.get("num_key_value_heads", num_heads)),
            head_dim=int(hf.get("head_dim") or hidden_size // num_heads),
            rope_theta=rope_theta, rope_scaling=rope_scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", hf.get("norm_eps", 1e-6))),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            sliding_window=next((w for w in windows if w is not None), None),
            layer_sliding_windows=windows,
            # Older LFM2 configs say `tie_embedding`.
            tie_word_embeddings=bool(hf.get("tie_word_embeddings",
                                            hf.get("tie_embedding", False))),
            qk_norm=spec.qk_norm, name=name, **_bias_flags(hf, spec, path),
            **_special_ids(hf, path),
            conv_layer_indices=conv_layers, conv_kernel_size=int(hf.get("conv_L_cache", 3)),
            conv_bias=bool(hf.get("conv_bias", False)))
    except ModelLoadError:
        raise
    except KeyError as exc:
        raise ModelLoadError(path, f"missing required key {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(path, f"invalid value: {exc}") from exc
