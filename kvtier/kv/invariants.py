"""Structural invariants of the KV cache; tests run them after every scenario.

Each check raises AssertionError naming what is broken (explicit raises, so `python -O` keeps
them).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.kv.block_pool import BlockPool
    from kvtier.kv.coordinator import KVCacheCoordinator


def check_manager_invariants(coordinator: KVCacheCoordinator, detached_blocks: Counter[int],
                             active_request_ids: set[str] | None) -> None:
    pool = coordinator.block_pool
    _check_null_block(pool)
    _check_free_queue(pool)
    _check_ref_counts(coordinator, detached_blocks)
    _check_cache_map(pool)
    _check_request_state(coordinator, active_request_ids)


def _fail(message: str) -> None:
    raise AssertionError(f"KV cache invariant broken: {message}")


def _check_null_block(pool: BlockPool) -> None:
    null = pool.null_block
    if null.block_id != 0 or not null.is_null:
        _fail(f"the null block must be block 0, got {null}")
    if null.ref_cnt != 0 or null.cache_key is not None:
        _fail(f"the null block was touched: {null}")
    if null.prev_free_block is not None or null.next_free_block is not None:
        _fail("the null block is linked into the free queue")
    others = [b.block_id for b in pool.blocks[1:] if b.is_null]
    if others:
        _fail(f"blocks {others} are marked null; only block 0 may be")


def _check_free_queue(pool: BlockPool) -> None:
    queue = pool.free_block_queue
    walked = queue.get_all_free_blocks()
    if len(walked) != queue.num_free_blocks:
        _fail(f"free queue holds {len(walked)} blocks but counts {queue.num_free_blocks}")
    prev = None
    for block in walked:
        if prev is not None and block.prev_free_block is not prev:
            _fail(f"broken back link at {block}")
        prev = block
    walked_ids = [b.block_id for b in walked]
    if len(set(walked_ids)) != len(walked_ids):
        _fail(f"free queue holds a block twice: {walked_ids}")
    zero_ref = {b.block_id for b in pool.blocks[1:] if b.ref_cnt == 0}
    if set(walked_ids) != zero_ref:
        _fail(f"free queue {sorted(walked_ids)} != blocks with ref_cnt 0 {sorted(zero_ref)}")


def _check_ref_counts(coordinator: KVCacheCoordinator, detached: Counter[int]) -> None:
    holders: Counter[int] = Counter(detached)
    owner_group: dict[int, int] = {}
    for manager in coordinator.managers:
        group_id = manager.kv_cache_group_id
        for blocks in manager.req_to_blocks.values():
            for block in blocks:
                if block.is_null:
                    continue
                if owner_group.setdefault(block.block_id, group_id) != group_id:
                    _fail(f"block {block.block_id} is held by groups "
                          f"{owner_group[block.block_id]} and {group_id}")
                holders[block.block_id] += 1
    for block in coordinator.block_pool.blocks[1:]:
        if block.ref_cnt != holders[block.block_id]:
            _fail(f"block {block.block_id} has ref_cnt {block.ref_cnt} but "
                  f"{holders[block.block_id]} holders")


def _check_cache_map(pool: BlockPool) -> None:
    num_mapped = 0
    for key, entry in pool.cached_block_hash_to_block.items():
        blocks = [entry] if not isinstance(entry, dict) else list(entry.values())
        if isinstance(entry, dict) and len(entry) < 2:
            _fail(f"cache map entry for group {key[1]} is a dict of {len(entry)} block(s)")
        for block in blocks:
            if block.cache_key != key:
                _fail(f"{block} is mapped under a key it does not carry")
        num_mapped += len(blocks)
    num_hashed = sum(1 for b in pool.blocks if b.cache_key is not None)
    if num_mapped != num_hashed:
        _fail(f"{num_hashed} blocks carry a hash but {num_mapped} are in the cache map")


def _check_request_state(coordinator: KVCacheCoordinator,
                         active_request_ids: set[str] | None) -> None:
    first_ids = set(coordinator.managers[0].req_to_blocks)
    for manager in coordinator.managers:
        held = set(manager.req_to_blocks)
        if held != first_ids:
            _fail(f"group {manager.kv_cache_group_id} tracks requests {sorted(held)}, "
                  f"group 0 tracks {sorted(first_ids)}")
        extra = set(manager.num_cached_block) - held
        if extra:
            _fail(f"group {manager.kv_cache_group_id} has cached-block counts for requests "
                  f"{sorted(extra)} that hold no blocks")
        for request_id, num_cached in manager.num_cached_block.items():
            if num_cached > len(manager.req_to_blocks[request_id]):
                _fail(f"request {request_id!r} counts {num_cached} cached blocks in group "
                      f"{manager.kv_cache_group_id} but holds fewer")
    if active_request_ids is not None:
        leaked = first_ids - set(active_request_ids)
        if leaked:
            _fail(f"requests {sorted(leaked)} still hold KV state but are not active")
