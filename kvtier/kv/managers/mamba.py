"""Mamba: one recurrent state per request. Block j holds the state after its last token, so only
the latest block is needed and a hit is the single last aligned cached state."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtier.kv.block_pool import KVCacheBlock
from kvtier.kv.managers.base import SingleTypeKVCacheManager

if TYPE_CHECKING:
    from kvtier.kv.hashing import BlockHash


class MambaManager(SingleTypeKVCacheManager):

    skips_blocks = True

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int,
                               alignment_tokens: int) -> list[KVCacheBlock]:
        stride = self.hash_stride
        max_blocks = min(max_length // self.block_size, len(block_hashes) // stride)
        align_blocks = alignment_tokens // self.block_size
        lookup = self.block_pool.get_one_cached_block
        group_id = self.kv_cache_group_id
        for i in range(max_blocks - 1, -1, -1):
            if (i + 1) % align_blocks:
                continue
            block = lookup(block_hashes[(i + 1) * stride - 1], group_id)
            if block is not None:
                return [self.null_block] * i + [block]
        return []

    def can_resume_at(self, request_id: str, num_tokens: int) -> bool:
        # Only a block boundary has a state, and only the latest blocks are still held. The
        # recompute writes a state into every later block it holds: none may be null (an
        # external load past the hit leaves null blocks before its last state).
        if num_tokens == 0:
            return True
        if num_tokens % self.block_size:
            return False
        blocks = self.req_to_blocks.get(request_id, ())
        index = num_tokens // self.block_size - 1
        return index < len(blocks) and not any(b.is_null for b in blocks[index:])

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        # The state after n tokens lives in block cdiv(n, block_size) - 1; all before it go.
        return max(0, -(-num_computed_tokens // self.block_size) - 1)
