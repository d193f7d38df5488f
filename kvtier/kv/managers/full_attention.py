"""Full attention: every past block stays needed, so a hit is the leading run of cached blocks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtier.kv.block_pool import KVCacheBlock
from kvtier.kv.managers.base import SingleTypeKVCacheManager

if TYPE_CHECKING:
    from kvtier.kv.hashing import BlockHash


class FullAttentionManager(SingleTypeKVCacheManager):

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int,
                               alignment_tokens: int) -> list[KVCacheBlock]:
        stride = self.hash_stride
        num_blocks = min(max_length // self.block_size, len(block_hashes) // stride)
        lookup = self.block_pool.get_one_cached_block
        group_id = self.kv_cache_group_id
        hits: list[KVCacheBlock] = []
        for j in range(num_blocks):
            block = lookup(block_hashes[(j + 1) * stride - 1], group_id)
            if block is None:
                break
            hits.append(block)
        align_blocks = alignment_tokens // self.block_size
        if align_blocks > 1:
            del hits[len(hits) - len(hits) % align_blocks:]
        return hits
