"""The KV cache core: block hashing, block pool, specs, per-type managers, coordinators and the
scheduler-facing KVCacheManager. Pure Python: importing it never imports torch."""

from kvtier.kv.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from kvtier.kv.events import (
                              MEDIUM_DEVICE,
                              AllBlocksCleared,
                              BlockRemoved,
                              BlockStored,
                              KVCacheEvent,
)
from kvtier.kv.hashing import (
                              HASH_ALGOS,
                              BlockHash,
                              KVIdentity,
                              hash_block_tokens,
                              make_block_hasher,
                              namespace_digest,
                              seed_hash,
)
from kvtier.kv.kv_cache_manager import KVCacheBlocks, KVCacheManager
from kvtier.kv.request import MultiModalFeature, Request, RequestStatus
from kvtier.kv.specs import (
                              AttentionSpec,
                              FullAttentionSpec,
                              KVCacheConfig,
                              KVCacheGroupSpec,
                              KVCacheSpec,
                              MambaSpec,
                              SlidingWindowSpec,
)
from kvtier.kv.stats import PrefixCacheStats

__all__ = [
    "AllBlocksCleared", "AttentionSpec", "BlockHash", "BlockPool", "BlockRemoved", "BlockStored",
    "FreeKVCacheBlockQueue", "FullAttentionSpec", "HASH_ALGOS", "KVCacheBlock", "KVCacheBlocks",
    "KVCacheConfig", "KVCacheEvent", "KVCacheGroupSpec", "KVCacheManager", "KVCacheSpec",
    "KVIdentity", "MEDIUM_DEVICE", "MambaSpec", "MultiModalFeature", "PrefixCacheStats", "Request",
    "RequestStatus", "SlidingWindowSpec", "hash_block_tokens", "make_block_hasher",
    "namespace_digest", "seed_hash",
]
