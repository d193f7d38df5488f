"""Builders shared by the KV cache tests."""

from __future__ import annotations

from kvtier.kv import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    KVCacheSpec,
    MambaSpec,
    Request,
    RequestStatus,
    SlidingWindowSpec,
)

BLOCK_SIZE = 4


def full_spec(block_size: int = BLOCK_SIZE) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8)


def sliding_spec(window: int, block_size: int = BLOCK_SIZE) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=block_size, num_kv_heads=1, head_size=8,
                             sliding_window=window)


def mamba_spec(block_size: int = BLOCK_SIZE) -> MambaSpec:
    return MambaSpec(block_size=block_size, state_shapes=((2, 3),))


def config(num_blocks: int, *specs: KVCacheSpec) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(specs or
                                                                              (full_spec(),))]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=groups)


def make_request(manager: KVCacheManager, request_id: str, token_ids: list[int],
                 **kwargs) -> Request:
    return Request(request_id, token_ids, block_hasher=manager.make_block_hasher(), **kwargs)


def admit(manager: KVCacheManager, request: Request, num_new_tokens: int | None = None,
          **kwargs):
    """What the scheduler does for a waiting request: look up the prefix, then allocate."""
    hit_blocks, num_hit = manager.get_computed_blocks(request)
    if num_new_tokens is None:
        num_new_tokens = request.num_tokens - num_hit
    blocks = manager.allocate_slots(request, num_new_tokens, num_hit, hit_blocks, **kwargs)
    if blocks is not None:
        request.num_computed_tokens = num_hit + num_new_tokens
        request.status = RequestStatus.RUNNING
    return blocks, num_hit
