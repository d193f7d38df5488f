"""ModelConfig: the architecture facts the decoder, the runner and the KV cache need.

Parsed once from an HF config.json (`hf_config.py`) or GGUF metadata (`gguf_file.py`); never
mutated. Pure Python: the scheduler side may read it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "lfm2")
# rope_scaling["rope_type"] values the decoder implements (None = plain RoPE).
ROPE_TYPES = ("llama3",)
# The numbers each rope_type's frequency scaling reads.
ROPE_SCALING_KEYS = {"llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                "original_max_position_embeddings")}


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class KVCacheGroupLayout:
    """Layers that share one KV cache group: same attention kind, same window; or every
    short-convolution layer, whose group holds one recurrent state per block."""

    group_id: int
    # None: full attention (or a short-conv group).
    sliding_window: int | None
    layer_indices: tuple[int, ...]
    kind: Literal["attention", "short_conv"] = "attention"


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    # None, or {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}.
    rope_scaling: dict[str, Any] | None
    rms_norm_eps: float
    max_position_embeddings: int
    # The window of the sliding layers (None if every layer is full attention).
    sliding_window: int | None
    # Per layer: its window, or None for full attention.
    layer_sliding_windows: tuple[int | None, ...]
    tie_word_embeddings: bool
    # q/k/v projections carry a bias (Qwen2; Llama/Qwen3 when attention_bias is set).
    attention_bias: bool
    # o_proj carries a bias (Llama/Qwen3 attention_bias; Qwen2 never).
    o_proj_bias: bool
    # RMSNorm on each q and k head before RoPE (Qwen3).
    qk_norm: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Model id used in metrics and in the KV namespace.
    name: str
    # Layers that are gated short convolutions instead of attention (LFM2); their entries in
    # layer_sliding_windows are None and unused.
    conv_layer_indices: tuple[int, ...] = ()
    # Taps of each short convolution (HF's conv_L_cache): the state is the last taps - 1 inputs.
    conv_kernel_size: int = 3
    # Biases on the short convolutions' projections and taps.
    conv_bias: bool = False
    # gate/up/down projections carry a bias (Llama's mlp_bias).
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        _require(self.architecture in ARCHITECTURES,
                 f"architecture must be one of {ARCHITECTURES}, got {self.architecture!r}")
        for field_name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                           "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, field_name)
            _require(isinstance(value, int) and value >= 1,
                     f"{field_name} must be a positive int, got {value!r}")
        _require(self.num_heads % self.num_kv_heads == 0,
                 f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                 f"({self.num_kv_heads})")
        _require(self.head_dim % 2 == 0, f"head_dim must be even for RoPE, got {self.head_dim}")
        _require(len(self.layer_sliding_windows) == self.num_layers,
                 f"layer_sliding_windows has {len(self.layer_sliding_windows)} entries; "
                 f"it needs one per layer ({self.num_layers})")
        for window in self.layer_sliding_windows:
            _require(window is None or window >= 1,
                     f"layer_sliding_windows entries must be None or >= 1, got {window!r}")
        _require(all(0 <= i < self.num_layers for i in self.conv_layer_indices),
                 f"conv_layer_indices must lie in [0, {self.num_layers}), "
                 f"got {self.conv_layer_indices}")
        _require(self.conv_kernel_size >= 2,
                 f"conv_kernel_size must be >= 2, got {self.conv_kernel_size}")
        _require(self.rope_scaling is None or self.rope_scaling.get("rope_type") in ROPE_TYPES,
                 f"rope_scaling type must be one of {ROPE_TYPES} or None, "
                 f"got {self.rope_scaling!r}")
        if self.rope_scaling is not None:
            self._check_rope_scaling(self.rope_scaling)

    @staticmethod
    def _check_rope_scaling(scaling: dict[str, Any]) -> None:
        rope_type = scaling["rope_type"]
        for key in ROPE_SCALING_KEYS[rope_type]:
            value = scaling.get(key)
            _require(isinstance(value, int | float) and not isinstance(value, bool) and value > 0,
                     f"rope_scaling ({rope_type}) needs a positive number {key!r}, "
                     f"got {value!r}")

    @property
    def layer_names(self) -> tuple[str, ...]:
        """Cache-holding layer names (HF module paths) as the KV connector hooks and the
        runner see them."""
        conv = set(self.conv_layer_indices)
        return tuple(f"model.layers.{i}.conv" if i in conv else f"model.layers.{i}.self_attn"
                     for i in range(self.num_layers))

    def kv_cache_groups(self) -> tuple[KVCacheGroupLayout, ...]:
        """Attention layers grouped by window; group 0 is full attention if any layer has it,
        then the sliding windows in increasing order, then the short-conv layers if any."""
        conv = set(self.conv_layer_indices)
        attention = [(i, w) for i, w in enumerate(self.layer_sliding_windows) if i not in conv]
        windows = sorted({w for _, w in attention}, key=lambda w: (w is not None, w or 0))
        groups = [KVCacheGroupLayout(group_id=group_id, sliding_window=window,
                                     layer_indices=tuple(i for i, w in attention if w == window))
                  for group_id, window in enumerate(windows)]
        if conv:
            groups.append(KVCacheGroupLayout(group_id=len(groups), sliding_window=None,
                                             layer_indices=tuple(sorted(conv)),
                                             kind="short_conv"))
        return tuple(groups)

    @property
    def layer_group_ids(self) -> tuple[int, ...]:
        """Per layer: the id of its KV cache group."""
        group_of = {i: g.group_id for g in self.kv_cache_groups() for i in g.layer_indices}
        return tuple(group_of[i] for i in range(self.num_layers))
