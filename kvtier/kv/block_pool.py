"""BlockPool: every physical block, the free queue, and the prefix-cache map shared by all groups.

Eviction is lazy: a freed block keeps its hash (and stays findable) until it is popped for reuse.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from kvtier.kv.events import (
    MEDIUM_DEVICE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from kvtier.kv.kv_cache_block import BlockHashWithGroupId, FreeKVCacheBlockQueue, KVCacheBlock

if TYPE_CHECKING:
    from kvtier.kv.hashing import BlockHash
    from kvtier.kv.request import Request

__all__ = ["BlockPool", "FreeKVCacheBlockQueue", "KVCacheBlock"]


class BlockPool:
    """Owns blocks 0..num_blocks-1. Block 0 is the null block: never handed out, never freed."""

    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 enable_kv_cache_events: bool = False) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), "
                             f"got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        # (hash, group) -> block, or {block_id: block} when several blocks share a key: the map
        # does not deduplicate, so block tables stay append-only.
        self.cached_block_hash_to_block: dict[
            BlockHashWithGroupId, KVCacheBlock | dict[int, KVCacheBlock]] = {}
        self.kv_event_queue: list[KVCacheEvent] = []

    # ---- prefix-cache map ------------------------------------------------------------------

    def get_cached_block(self, block_hash: BlockHash,
                         kv_cache_group_ids: Sequence[int]) -> list[KVCacheBlock] | None:
        """One cached block per group for `block_hash`, or None if any group misses."""
        found = []
        for group_id in kv_cache_group_ids:
            block = self.get_one_cached_block(block_hash, group_id)
            if block is None:
                return None
            found.append(block)
        return found

    def get_one_cached_block(self, block_hash: BlockHash,
                             group_id: int) -> KVCacheBlock | None:
        entry = self.cached_block_hash_to_block.get((block_hash, group_id))
        if entry is None or isinstance(entry, KVCacheBlock):
            return entry
        return next(iter(entry.values()))

    def cache_full_blocks(self, request: Request, blocks: Sequence[KVCacheBlock],
                          num_cached_blocks: int, num_full_blocks: int, block_size: int,
                          kv_cache_group_id: int, hash_stride: int = 1) -> None:
        """Put blocks[num_cached_blocks:num_full_blocks] of `request` into the prefix map.

        Block j of this group is named by request.block_hashes[(j + 1) * hash_stride - 1]: the
        chained hash of the last hash-block it covers identifies the whole prefix up to it.
        Null blocks (positions a sliding window dropped) are skipped.
        """
        if not self.enable_caching:
            return
        hashes = request.block_hashes
        stored: list[BlockHash] = []
        for j in range(num_cached_blocks, num_full_blocks):
            block = blocks[j]
            if block.is_null or block.cache_key is not None:
                continue
            block_hash = hashes[(j + 1) * hash_stride - 1]
            self._insert(block, (block_hash, kv_cache_group_id))
            stored.append(block_hash)
        if self.enable_kv_cache_events and stored:
            self._record_stored(request, stored, num_cached_blocks, num_full_blocks, block_size,
                                kv_cache_group_id, hash_stride)

    def _record_stored(self, request: Request, stored: list[BlockHash], first: int,
                       end: int, block_size: int, group_id: int, hash_stride: int) -> None:
        parent = request.block_hashes[first * hash_stride - 1] if first > 0 else None
        self.kv_event_queue.append(BlockStored(
            block_hashes=stored, parent_block_hash=parent,
            token_ids=request.all_token_ids[first * block_size:end * block_size],
            block_size=block_size, lora_id=request.lora_name, medium=MEDIUM_DEVICE,
            group_idx=group_id))

    def _insert(self, block: KVCacheBlock, key: BlockHashWithGroupId) -> None:
        block.cache_key = key
        entry = self.cached_block_hash_to_block.get(key)
        if entry is None:
            self.cached_block_hash_to_block[key] = block
        elif isinstance(entry, KVCacheBlock):
            self.cached_block_hash_to_block[key] = {entry.block_id: entry, block.block_id: block}
        else:
            entry[block.block_id] = block

    def _uncache(self, block: KVCacheBlock) -> bool:
        """Drop `block` from the map (lazy eviction point). Returns whether it was cached."""
        key = block.cache_key
        if key is None:
            return False
        block.cache_key = None
        entry = self.cached_block_hash_to_block[key]
        if isinstance(entry, KVCacheBlock):
            del self.cached_block_hash_to_block[key]
        else:
            del entry[block.block_id]
            if len(entry) == 1:
                self.cached_block_hash_to_block[key] = next(iter(entry.values()))
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(
                BlockRemoved(block_hashes=[key[0]], medium=MEDIUM_DEVICE, group_idx=key[1]))
        return True

    # ---- allocation ------------------------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` from the head of the free queue, evicting their old hashes."""
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} blocks, only "
                             f"{self.free_block_queue.num_free_blocks} are free")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            if block.cache_key is not None:
                self._uncache(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take prefix-hit blocks: a free one leaves the queue; every one gains a reference."""
        queue = self.free_block_queue
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching 0 join the tail in the given order, so the
        first block passed is the first of them to be evicted."""
        queue = self.free_block_queue
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                queue.append(block)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the cached hashes of these blocks (e.g. their load failed); blocks stay where
        they are, allocated or free."""
        for block_id in block_ids:
            self._uncache(self.blocks[block_id])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any block is in use."""
        num_used = self.num_blocks - 1 - self.free_block_queue.num_free_blocks
        if num_used > 0:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.cache_key = None
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    # ---- accounting ------------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of allocatable blocks in use (the null block does not count)."""
        return 1.0 - self.free_block_queue.num_free_blocks / (self.num_blocks - 1)

    def take_events(self) -> list[KVCacheEvent]:
        events, self.kv_event_queue = self.kv_event_queue, []
        return events
