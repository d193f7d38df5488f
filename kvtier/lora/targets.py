"""Where LoRA adapters attach to the decoder: the projections of its attention and MLP blocks.

q/k/v and gate/up are fused in kvtier's decoder (`qkv_proj`, `gate_up_proj`), so an adapter's
`q_proj` names rows [0, q) of `qkv_proj`, its `k_proj` the next rows, and so on.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from kvtier.models.llama import MLP, Attention


@dataclass(frozen=True)
class LoRATarget:
    module: str  # our module's path, e.g. "model.layers.0.self_attn.qkv_proj"
    row_start: int  # the piece's first output row within that module
    out_features: int
    in_features: int
    module_out_features: int  # the whole (fused) module's output rows


def find_targets(model: nn.Module) -> dict[str, LoRATarget]:
    """HF module name an adapter may name (after the model's `hf_renames`), e.g.
    "model.layers.0.self_attn.q_proj" -> where its product goes."""
    config = model.config
    hidden, inter = config.hidden_size, config.intermediate_size
    q_rows = config.num_heads * config.head_dim
    kv_rows = config.num_kv_heads * config.head_dim
    targets: dict[str, LoRATarget] = {}

    def add(prefix: str, fused: str, pieces: list[tuple[str, int]], in_features: int) -> None:
        start, total = 0, sum(rows for _, rows in pieces)
        for piece, rows in pieces:
            targets[f"{prefix}.{piece}"] = LoRATarget(f"{prefix}.{fused}", start, rows,
                                                      in_features, total)
            start += rows

    for name, module in model.named_modules():
        if isinstance(module, Attention):
            add(name, "qkv_proj", [("q_proj", q_rows), ("k_proj", kv_rows),
                                   ("v_proj", kv_rows)], hidden)
            add(name, "o_proj", [("o_proj", hidden)], q_rows)
        elif isinstance(module, MLP):
            add(name, "gate_up_proj", [("gate_proj", inter), ("up_proj", inter)], hidden)
            add(name, "down_proj", [("down_proj", hidden)], inter)
    return targets
