"""The device KV cache: which layers share a KV cache group, how many blocks fit, and the
per-layer tensors, allocated once at start-up."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from kvtier.kv import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

if TYPE_CHECKING:
    from kvtier.models.config import ModelConfig


def layer_name(index: int) -> str:
    return f"model.layers.{index}.self_attn"


def build_kv_cache_groups(model_config: ModelConfig, *, block_size: int,
                          dtype_size: int) -> list[KVCacheGroupSpec]:
    """One KV cache group per distinct sliding window, numbered as the model numbers them."""
    groups = []
    for layout in model_config.kv_cache_groups():
        shape = (block_size, model_config.num_kv_heads, model_config.head_dim, dtype_size)
        if layout.sliding_window is None:
            spec = FullAttentionSpec(*shape)
        else:
            spec = SlidingWindowSpec(*shape, sliding_window=layout.sliding_window)
        names = [layer_name(index) for index in layout.layer_indices]
        groups.append(KVCacheGroupSpec(names, spec))
    return groups


def plan_num_blocks(*, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype_size: int, memory_bytes: int | None, num_blocks: int | None,
                    max_num_seqs: int, max_model_len: int) -> int:
    """Blocks in the shared pool (null block included). Every layer holds one page per block."""
    if num_blocks is not None:
        return num_blocks
    page_bytes = 2 * block_size * num_kv_heads * head_dim * dtype_size  # K and V of one layer
    fitting = memory_bytes // (num_layers * page_bytes)
    # More blocks than every sequence at full length can use would only cost start-up time.
    useful = max_num_seqs * math.ceil(max_model_len / block_size) + 1
    planned = min(fitting, useful)
    if planned < 2:
        raise ValueError(f"kv_cache_memory_bytes={memory_bytes} holds {fitting} KV blocks of "
                         f"{num_layers * page_bytes} bytes; give at least "
                         f"{2 * num_layers * page_bytes} bytes")
    return planned


def allocate_kv_caches(config: KVCacheConfig, *, num_layers: int, dtype: torch.dtype,
                       device: torch.device) -> list[torch.Tensor]:
    """One zeroed tensor per layer, in layer order; zeros so padded reads are finite."""
    specs = {name: group.kv_cache_spec for group in config.kv_cache_groups
             for name in group.layer_names}
    caches = []
    for index in range(num_layers):
        spec = specs[layer_name(index)]
        # (K|V, num_blocks, block_size, num_kv_heads, head_dim)
        shape = (2, config.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
        caches.append(torch.zeros(shape, dtype=dtype, device=device))
    return caches
