"""The device KV cache: which layers share a KV cache group, how many blocks fit, and the
per-layer tensors, allocated once at start-up.

Every layer's tensor has one page per block of the shared pool at dim 1: attention layers
(K|V, num_blocks, block_size, num_kv_heads, head_dim), short-conv layers
(1, num_blocks, *state shape) (kvtier.models.short_conv)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvtier.common.huge_pages import advise_huge_pages
from kvtier.common.memory import available_memory_bytes, format_bytes
from kvtier.kv import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

if TYPE_CHECKING:
    from kvtier.models.config import ModelConfig


def build_kv_cache_groups(model_config: ModelConfig, *, block_size: int, dtype_size: int,
                          kv_dtype_size: int | None = None) -> list[KVCacheGroupSpec]:
    """One KV cache group per distinct sliding window, and one for the short-conv layers (a
    recurrent state per block), numbered as the model numbers them. `dtype_size`: bytes of
    the model dtype (short-conv states); `kv_dtype_size`: of a stored K or V element (None:
    the same)."""
    groups = []
    for layout in model_config.kv_cache_groups():
        shape = (block_size, model_config.num_kv_heads, model_config.head_dim,
                 kv_dtype_size or dtype_size)
        spec: KVCacheSpec
        if layout.kind == "short_conv":
            state = (model_config.conv_kernel_size - 1, model_config.hidden_size)
            spec = MambaSpec(block_size, (state,), dtype_size)
        elif layout.sliding_window is None:
            spec = FullAttentionSpec(*shape)
        else:
            spec = SlidingWindowSpec(*shape, sliding_window=layout.sliding_window)
        names = [model_config.layer_names[index] for index in layout.layer_indices]
        groups.append(KVCacheGroupSpec(names, spec))
    return groups


def block_bytes(groups: list[KVCacheGroupSpec]) -> int:
    """Bytes one block of the pool takes over all layers (each layer has a page per block)."""
    return sum(len(g.layer_names) * g.kv_cache_spec.page_size_bytes for g in groups)


def device_memory_bytes(device: torch.device) -> int | None:
    """Bytes a KV cache could still take on `device` (CUDA: its free memory; CPU: the machine's
    available memory); None where that is not known."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        return available_memory_bytes()
    return None


def plan_num_blocks(*, block_bytes: int, block_size: int, memory_bytes: int | None,
                    num_blocks: int | None, max_num_seqs: int, max_model_len: int,
                    available_bytes: int | None = None) -> int:
    """Blocks in the shared pool (null block included); `block_bytes`: one block, all layers;
    `available_bytes`: what the device can hold (device_memory_bytes), None: unchecked."""
    if num_blocks is not None:
        _require_fits(num_blocks, block_bytes, available_bytes, "--num-device-blocks")
        return num_blocks
    fitting = memory_bytes // block_bytes
    # More blocks than every sequence at full length can use would only cost start-up time.
    useful = max_num_seqs * math.ceil(max_model_len / block_size) + 1
    planned = min(fitting, useful)
    if planned < 2:
        raise ValueError(f"kv_cache_memory_bytes={memory_bytes} holds {fitting} KV blocks of "
                         f"{block_bytes} bytes; give at least {2 * block_bytes} bytes")
    _require_fits(planned, block_bytes, available_bytes, "--kv-cache-memory-bytes")
    return planned


def _require_fits(num_blocks: int, block_bytes: int, available_bytes: int | None,
                  flag: str) -> None:
    """Refuse a pool the device cannot hold: allocating it would fail only after exhausting
    memory (on the CPU, often the OOM killer ending the process with no message)."""
    needed = num_blocks * block_bytes
    if available_bytes is None or needed <= available_bytes:
        return
    most = (f"{flag} {available_bytes // block_bytes}" if flag == "--num-device-blocks"
            else f"{flag} {available_bytes}")
    raise ValueError(f"{flag}: {num_blocks} KV blocks of {block_bytes} bytes need {needed} "
                     f"bytes ({format_bytes(needed)}), more than the device has available "
                     f"({format_bytes(available_bytes)}); give at most {most}")


def allocate_kv_caches(config: KVCacheConfig, *, layer_names: Sequence[str], dtype: torch.dtype,
                       device: torch.device, kv_dtype: torch.dtype | None = None
                       ) -> list[torch.Tensor]:
    """One zeroed tensor per layer, in the order of `layer_names`; zeros so padded reads are
    finite. Attention layers hold `kv_dtype` (None: `dtype`), short-conv states `dtype`."""
    specs = {name: group.kv_cache_spec for group in config.kv_cache_groups
             for name in group.layer_names}
    caches = []
    for name in layer_names:
        spec = specs[name]
        if isinstance(spec, MambaSpec):
            (state_shape,) = spec.state_shapes
            caches.append(_zeros((1, config.num_blocks, *state_shape), dtype, device))
        else:
            # (K|V, num_blocks, block_size, num_kv_heads, head_dim)
            shape = (2, config.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
            caches.append(_zeros(shape, kv_dtype or dtype, device))
    return caches


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros; on the CPU, on transparent huge pages where the OS gives them (asked for
    before the zeroing faults the pages in): loads and stores copy pages in and out of scattered
    blocks, which 4 KB pages slow down in a large cache (kvtier.common.huge_pages)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    tensor = torch.empty(shape, dtype=dtype)
    advise_huge_pages(tensor.data_ptr(), tensor.numel() * tensor.element_size())
    return tensor.zero_()
