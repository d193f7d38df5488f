"""Per-spec-type managers, chosen from a table rather than from `if` chains."""

from __future__ import annotations

from kvtier.kv.block_pool import BlockPool
from kvtier.kv.managers.base import SingleTypeKVCacheManager
from kvtier.kv.managers.full_attention import FullAttentionManager
from kvtier.kv.managers.mamba import MambaManager
from kvtier.kv.managers.sliding_window import SlidingWindowManager
from kvtier.kv.specs import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec

SPEC_MANAGER_MAP: dict[type[KVCacheSpec], type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    MambaSpec: MambaManager,
}


def get_manager_for_kv_cache_spec(kv_cache_spec: KVCacheSpec, block_pool: BlockPool,
                                  kv_cache_group_id: int,
                                  hash_block_size: int) -> SingleTypeKVCacheManager:
    manager_cls = SPEC_MANAGER_MAP.get(type(kv_cache_spec))
    if manager_cls is None:
        raise ValueError(f"kv_cache_spec of group {kv_cache_group_id} has unsupported type "
                         f"{type(kv_cache_spec).__name__}; supported: "
                         f"{', '.join(t.__name__ for t in SPEC_MANAGER_MAP)}")
    return manager_cls(kv_cache_spec, block_pool, kv_cache_group_id, hash_block_size)


__all__ = ["FullAttentionManager", "MambaManager", "SPEC_MANAGER_MAP", "SingleTypeKVCacheManager",
           "SlidingWindowManager", "get_manager_for_kv_cache_spec"]
