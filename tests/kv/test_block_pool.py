"""BlockPool and the intrusive free queue: exact ids, orders and lazy eviction."""

from __future__ import annotations

import pytest

from kvtier.kv import (
    AllBlocksCleared,
    BlockPool,
    BlockRemoved,
    BlockStored,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    Request,
    make_block_hasher,
)


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def queue_ids(pool: BlockPool) -> list[int]:
    return ids(pool.free_block_queue.get_all_free_blocks())


def cached_request(pool: BlockPool, token_ids: list[int], group_id: int = 0) -> tuple:
    request = Request("r", token_ids, block_hasher=make_block_hasher(4))
    blocks = pool.get_new_blocks(len(token_ids) // 4)
    pool.cache_full_blocks(request, blocks, 0, len(blocks), 4, group_id)
    return request, blocks


def test_free_queue_operations_keep_order_and_count():
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    assert queue.popleft() is blocks[0]
    assert ids(queue.popleft_n(2)) == [1, 3]
    queue.append(blocks[0])
    queue.append_n([blocks[2], blocks[1]])
    assert ids(queue.get_all_free_blocks()) == [4, 5, 0, 2, 1]
    assert queue.num_free_blocks == 5
    with pytest.raises(ValueError, match="only 5 are free"):
        queue.popleft_n(6)
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(blocks[3])
    assert ids(queue.popleft_n(5)) == [4, 5, 0, 2, 1]
    with pytest.raises(ValueError, match="no free blocks"):
        queue.popleft()


def test_pool_reserves_null_block_and_counts_usage():
    pool = BlockPool(5)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert queue_ids(pool) == [1, 2, 3, 4]
    assert ids(pool.get_new_blocks(3)) == [1, 2, 3]
    assert pool.get_usage() == 0.75
    with pytest.raises(ValueError, match="num_blocks must be >= 2"):
        BlockPool(1)


def test_freed_blocks_keep_hashes_until_reused():
    pool = BlockPool(5, enable_kv_cache_events=True)
    request, blocks = cached_request(pool, list(range(8)))
    pool.free_blocks(reversed(blocks))
    assert queue_ids(pool) == [3, 4, 2, 1]
    assert pool.get_cached_block(request.block_hashes[1], [0]) == [blocks[1]]
    assert ids(pool.get_new_blocks(3)) == [3, 4, 2]
    # Block 2 was popped for reuse: only now does its hash leave the map.
    assert pool.get_cached_block(request.block_hashes[1], [0]) is None
    assert pool.get_cached_block(request.block_hashes[0], [0]) == [blocks[0]]
    assert pool.take_events() == [
        BlockStored(block_hashes=request.block_hashes, parent_block_hash=None,
                    token_ids=list(range(8)), block_size=4, lora_id=None, medium="device",
                    group_idx=0),
        BlockRemoved(block_hashes=[request.block_hashes[1]], medium="device", group_idx=0)]
    assert pool.take_events() == []


def test_touch_takes_free_blocks_out_of_the_queue():
    pool = BlockPool(5)
    _, blocks = cached_request(pool, list(range(8)))
    pool.free_blocks(reversed(blocks))
    pool.touch([blocks[0], pool.null_block])
    assert (blocks[0].ref_cnt, pool.null_block.ref_cnt) == (1, 0)
    assert queue_ids(pool) == [3, 4, 2]
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 2
    pool.free_blocks([blocks[0], blocks[0]])
    assert queue_ids(pool) == [3, 4, 2, 1]


def test_cache_map_does_not_deduplicate():
    pool = BlockPool(6)
    request, first = cached_request(pool, list(range(4)))
    _, second = cached_request(pool, list(range(4)))
    key = (request.block_hashes[0], 0)
    assert pool.cached_block_hash_to_block[key] == {1: first[0], 2: second[0]}
    pool.evict_blocks([1])
    assert pool.cached_block_hash_to_block[key] is second[0]
    assert first[0].block_hash is None and first[0].ref_cnt == 1


def test_groups_have_separate_keys():
    pool = BlockPool(6)
    request, _ = cached_request(pool, list(range(4)), group_id=1)
    assert pool.get_cached_block(request.block_hashes[0], [1]) is not None
    assert pool.get_cached_block(request.block_hashes[0], [0, 1]) is None


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(5, enable_kv_cache_events=True)
    _, blocks = cached_request(pool, list(range(8)))
    pool.take_events()
    assert pool.reset_prefix_cache() is False
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.cached_block_hash_to_block == {}
    assert [b.block_hash for b in pool.blocks] == [None] * 5
    assert pool.take_events() == [AllBlocksCleared()]


def test_caching_disabled_pool_stores_nothing():
    pool = BlockPool(5, enable_caching=False)
    cached_request(pool, list(range(8)))
    assert pool.cached_block_hash_to_block == {}
