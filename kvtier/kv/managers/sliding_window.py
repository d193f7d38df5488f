"""Sliding window: only the last `sliding_window` tokens are attended, so older blocks are
dropped (replaced by the null block) and a hit needs only the blocks inside the window."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtier.kv.block_pool import BlockPool, KVCacheBlock
from kvtier.kv.managers.base import SingleTypeKVCacheManager
from kvtier.kv.specs import SlidingWindowSpec

if TYPE_CHECKING:
    from kvtier.kv.hashing import BlockHash


class SlidingWindowManager(SingleTypeKVCacheManager):

    skips_blocks = True

    def __init__(self, kv_cache_spec: SlidingWindowSpec, block_pool: BlockPool,
                 kv_cache_group_id: int, hash_block_size: int) -> None:
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id, hash_block_size)
        self.sliding_window = kv_cache_spec.sliding_window
        # The token after a hit of L tokens attends to [L - window + 1, L]: the hit's last
        # window - 1 tokens, which span this many blocks when L is block-aligned.
        self.num_window_blocks = -(-(self.sliding_window - 1) // self.block_size)

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int,
                               alignment_tokens: int) -> list[KVCacheBlock]:
        """Rightmost aligned run of `num_window_blocks` cached blocks, null blocks before it;
        with no such run, the leading run of cached blocks from block 0."""
        stride = self.hash_stride
        max_blocks = min(max_length // self.block_size, len(block_hashes) // stride)
        align_blocks = alignment_tokens // self.block_size
        needed = self.num_window_blocks
        if needed == 0:
            return [self.null_block] * (max_blocks - max_blocks % align_blocks)
        lookup = self.block_pool.get_one_cached_block
        group_id = self.kv_cache_group_id
        hits = [self.null_block] * max_blocks
        run = 0
        for i in range(max_blocks - 1, -1, -1):
            block = lookup(block_hashes[(i + 1) * stride - 1], group_id)
            if block is None:
                run = 0
                continue
            hits[i] = block
            run += 1
            # Scanning leftwards, i + needed walks down through the run's possible hit ends.
            if run >= needed and (i + needed) % align_blocks == 0:
                del hits[i + needed:]
                return hits
        del hits[run - run % align_blocks:]
        return hits

    def can_resume_at(self, request_id: str, num_tokens: int) -> bool:
        # The next token attends the window's earlier tokens: their blocks must still be held.
        # The recomputed tokens are written from there on: an external load that reached past
        # the window left null blocks there, which must not be written.
        first = max(0, num_tokens - self.sliding_window + 1) // self.block_size
        end = -(-num_tokens // self.block_size)
        blocks = self.req_to_blocks.get(request_id, ())
        return end <= len(blocks) and not any(b.is_null for b in blocks[first:])

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        num_skipped_tokens = max(0, num_computed_tokens - self.sliding_window + 1)
        return num_skipped_tokens // self.block_size
