"""A physical KV block and the intrusive doubly linked queue of free blocks."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.kv.hashing import BlockHash

# Cache-map key: the block hash plus the KV cache group that holds it.
BlockHashWithGroupId = tuple["BlockHash", int]


class KVCacheBlock:
    """One block of the shared pool. `ref_cnt == 0` <=> it is in the free queue (the null
    block aside). The prev/next links belong to the free queue, so queue moves allocate nothing."""

    __slots__ = ("block_id", "ref_cnt", "cache_key", "prev_free_block", "next_free_block",
                 "is_null")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # (hash, group id) while the block is in the prefix-cache map, else None.
        self.cache_key: BlockHashWithGroupId | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False

    @property
    def block_hash(self) -> BlockHash | None:
        return None if self.cache_key is None else self.cache_key[0]

    def __repr__(self) -> str:
        hash_hex = None if self.cache_key is None else self.cache_key[0][:4].hex()
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={hash_hex})"


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order: the head is evicted (reused) first, frees go to the tail.

    Two sentinel blocks bound the list so no operation needs a None check at the ends.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is self._tail or block is None:
            raise ValueError("no free blocks left to pop")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"cannot pop {n} blocks, only {self.num_free_blocks} are free")
        popped: list[KVCacheBlock] = []
        block = self._head.next_free_block
        for _ in range(n):
            popped.append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        self._head.next_free_block = block
        block.prev_free_block = self._head
        self.num_free_blocks -= n
        return popped

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        last = self._tail.prev_free_block
        count = 0
        for block in blocks:
            last.next_free_block = block
            block.prev_free_block = last
            last = block
            count += 1
        last.next_free_block = self._tail
        self._tail.prev_free_block = last
        self.num_free_blocks += count

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Head-to-tail snapshot (tests and invariant checks; not for hot paths)."""
        blocks = []
        block = self._head.next_free_block
        while block is not self._tail:
            blocks.append(block)
            block = block.next_free_block
        return blocks
