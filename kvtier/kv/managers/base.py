"""Per-request block tables of one KV cache group; the spec-specific rules live in subclasses.

A subclass decides two things: which cached blocks make a usable prefix hit
(`find_longest_cache_hit`) and which leading blocks a request no longer needs
(`num_skipped_blocks`). Everything else, allocation, caching and freeing, is shared.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from kvtier.kv.block_pool import BlockPool, KVCacheBlock
from kvtier.kv.specs import KVCacheSpec

if TYPE_CHECKING:
    from kvtier.kv.hashing import BlockHash
    from kvtier.kv.request import Request

# Shared "nothing allocated" result: a decode step that fills no block must not allocate a list.
_NO_BLOCKS: list[KVCacheBlock] = []


class SingleTypeKVCacheManager(ABC):
    """Block tables of every request for one group, all drawing from the shared pool."""

    # Whether `num_skipped_blocks` can ever be non-zero; lets the coordinator skip the work.
    skips_blocks: ClassVar[bool] = False

    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool,
                 kv_cache_group_id: int, hash_block_size: int) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        if self.block_size % hash_block_size:
            raise ValueError(f"block_size {self.block_size} of group {kv_cache_group_id} must "
                             f"be a multiple of the hash block size {hash_block_size}")
        # Request hashes are per hash block; this group's block j is named by hash
        # (j + 1) * hash_stride - 1, the chained hash of its last hash block.
        self.hash_stride = self.block_size // hash_block_size
        self.block_pool = block_pool
        self.kv_cache_group_id = kv_cache_group_id
        self.null_block = block_pool.null_block
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Number of leading blocks of each request already in the prefix map (or null).
        self.num_cached_block: dict[str, int] = {}

    # ---- spec-specific rules ---------------------------------------------------------------

    @abstractmethod
    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int,
                               alignment_tokens: int) -> list[KVCacheBlock]:
        """Blocks of the longest usable hit of at most `max_length` tokens whose length is a
        multiple of `alignment_tokens` (itself a multiple of this group's block size).
        Positions this group does not need are filled with the null block."""

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks no longer needed once `num_computed_tokens` tokens are computed."""
        return 0

    def can_resume_at(self, request_id: str, num_tokens: int) -> bool:
        """Whether the blocks the request holds let it go on from `num_tokens` computed tokens
        (after its later tokens were found bad): it reads what it needs before `num_tokens`
        and writes the recomputed positions from there up to what it holds, so none of those
        blocks may be the null block. True here: every block stays held."""
        return True

    # ---- allocation --------------------------------------------------------------------------

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock],
                                   num_computed_tokens: int) -> int:
        """Free-pool blocks that covering `num_tokens` positions would take: new blocks
        (positions before the skip line get the null block instead) plus the hit blocks that
        are currently free, because touching them takes them out of the free pool."""
        held = self.req_to_blocks.get(request_id, _NO_BLOCKS)
        num_existing = len(held) + len(new_computed_blocks)
        num_required = -(-num_tokens // self.block_size)
        num_new = max(0, num_required - num_existing)
        num_skipped = self.num_skipped_blocks(num_computed_tokens) if self.skips_blocks else 0
        if num_new and num_skipped:
            num_new -= max(0, min(num_required, num_skipped) - num_existing)
        # Hit blocks before the skip line are not taken (see save_new_computed_blocks).
        for block in new_computed_blocks[num_skipped:]:
            if block.ref_cnt == 0 and not block.is_null:
                num_new += 1
        return num_new

    def save_new_computed_blocks(self, request_id: str,
                                 new_computed_blocks: Sequence[KVCacheBlock],
                                 num_computed_tokens: int) -> None:
        """Take a prefix hit for a request that holds no blocks yet and starts with
        `num_computed_tokens` computed (the hit, then external tokens a connector loads).
        Hit blocks those tokens already push before the skip line are not taken: they get
        the null block, as positions the window left behind do."""
        if self.req_to_blocks.get(request_id):
            raise ValueError(f"request {request_id!r} already holds blocks; a prefix hit can "
                             "only be taken before its first allocation")
        blocks = list(new_computed_blocks)
        if self.skips_blocks:
            num_skipped = min(self.num_skipped_blocks(num_computed_tokens), len(blocks))
            blocks[:num_skipped] = [self.null_block] * num_skipped
        self.block_pool.touch(blocks)
        self.req_to_blocks[request_id] = blocks
        self.num_cached_block[request_id] = len(blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int,
                            num_computed_tokens: int) -> list[KVCacheBlock]:
        """Grow the request's table to cover `num_tokens` positions; returns the appended
        entries (null entries included, so block tables stay position-aligned)."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            blocks = self.req_to_blocks[request_id] = []
        num_held = len(blocks)
        num_required = -(-num_tokens // self.block_size)
        if num_required <= num_held:
            return _NO_BLOCKS
        if self.skips_blocks:
            num_null = min(num_required, self.num_skipped_blocks(num_computed_tokens)) - num_held
            if num_null > 0:
                blocks.extend([self.null_block] * num_null)
        blocks.extend(self.block_pool.get_new_blocks(num_required - len(blocks)))
        return blocks[num_held:]

    # ---- skipping ------------------------------------------------------------------------------

    def count_freeable_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> int:
        """Blocks `remove_skipped_blocks` would return to the free pool (touches nothing)."""
        count = 0
        for block in self._skippable(request_id, num_computed_tokens):
            if block.ref_cnt == 1:
                count += 1
        return count

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Replace blocks before the skip line by the null block and free them, last first."""
        removed = self._skippable(request_id, num_computed_tokens)
        if not removed:
            return
        blocks = self.req_to_blocks[request_id]
        end = self._skip_end(request_id, num_computed_tokens)
        for i in range(end - len(removed), end):
            blocks[i] = self.null_block
        self.block_pool.free_blocks(removed)

    def _skip_end(self, request_id: str, num_computed_tokens: int) -> int:
        blocks = self.req_to_blocks.get(request_id, _NO_BLOCKS)
        return min(self.num_skipped_blocks(num_computed_tokens), len(blocks))

    def _skippable(self, request_id: str, num_computed_tokens: int) -> list[KVCacheBlock]:
        """Non-null blocks before the skip line, last first. Earlier skips already nulled a
        prefix, so the walk stops at the first null block."""
        end = self._skip_end(request_id, num_computed_tokens)
        if end == 0:
            return _NO_BLOCKS
        blocks = self.req_to_blocks[request_id]
        found = []
        for i in range(end - 1, -1, -1):
            block = blocks[i]
            if block.is_null:
                break
            found.append(block)
        return found

    # ---- caching and release -----------------------------------------------------------------

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Put the request's blocks that are full within `num_tokens` into the prefix map."""
        request_id = request.request_id
        num_cached = self.num_cached_block.get(request_id, 0)
        num_full = min(num_tokens // self.block_size,
                       len(request.block_hashes) // self.hash_stride)
        if num_full <= num_cached:
            return
        self.block_pool.cache_full_blocks(request, self.req_to_blocks[request_id], num_cached,
                                          num_full, self.block_size, self.kv_cache_group_id,
                                          self.hash_stride)
        self.num_cached_block[request_id] = num_full

    def pop_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """Forget the request and hand back its blocks in free order (last block first)."""
        self.num_cached_block.pop(request_id, None)
        blocks = self.req_to_blocks.pop(request_id, None)
        if not blocks:
            return []
        blocks.reverse()
        return blocks

    def free(self, request_id: str) -> None:
        """Release the request's blocks in reverse order so its tail is evicted first."""
        blocks = self.pop_blocks(request_id)
        if blocks:
            self.block_pool.free_blocks(blocks)
