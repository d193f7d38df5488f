"""Coordinators: one hit length that every group accepts."""

from __future__ import annotations

from kvtier.kv.coordinator import (
    HybridKVCacheCoordinator,
    KVCacheCoordinatorNoPrefixCache,
    UnitaryKVCacheCoordinator,
)

from .kv_helpers import admit, full_spec, make_request, sliding_spec


def test_coordinator_kind_follows_groups_and_caching(make_manager):
    assert type(make_manager().coordinator) is UnitaryKVCacheCoordinator
    assert type(make_manager(11, full_spec(), sliding_spec(8)).coordinator) \
        is HybridKVCacheCoordinator
    assert type(make_manager(enable_caching=False).coordinator) \
        is KVCacheCoordinatorNoPrefixCache


def cached_hybrid(make_manager, *specs, num_tokens: int = 17):
    manager = make_manager(21, *specs)
    owner = make_request(manager, "owner", list(range(num_tokens)))
    admit(manager, owner)
    manager.free(owner)
    return manager, make_request(manager, "probe", list(range(num_tokens)))


def test_full_and_sliding_window_hits_reconcile(make_manager):
    # Window 5 with block 4: the sliding group needs only the hit's last block.
    manager, probe = cached_hybrid(make_manager, full_spec(), sliding_spec(window=5))
    # Group 0 (full) got blocks 1..5, group 1 (sliding) 6..10 for the 17-token owner.
    hit, num_hit = manager.get_computed_blocks(probe)
    assert (hit.get_block_ids(), num_hit) == (([1, 2, 3, 4], [0, 0, 0, 9]), 16)

    manager.evict_blocks({9})  # sliding block at position 3: its hit shrinks to 12
    hit, num_hit = manager.get_computed_blocks(probe)
    assert (hit.get_block_ids(), num_hit) == (([1, 2, 3], [0, 0, 8]), 12)

    manager.evict_blocks({3})  # full block at position 2: full stops at 8, sliding follows
    hit, num_hit = manager.get_computed_blocks(probe)
    assert (hit.get_block_ids(), num_hit) == (([1, 2], [0, 7]), 8)

    blocks = manager.allocate_slots(probe, probe.num_tokens - num_hit, num_hit, hit)
    # Groups allocate in group order from one pool: full first, then sliding.
    assert blocks.get_block_ids() == ([11, 12, 13], [14, 15, 16])
    assert manager.get_block_ids("probe") == ([1, 2, 11, 12, 13], [0, 7, 14, 15, 16])
    manager.free(probe)


def test_hybrid_hits_align_to_lcm_of_block_sizes(make_manager):
    # Full attention with 4-token blocks, sliding window with 8-token blocks: hits are
    # multiples of 8 and request hashes are cut every 4 tokens.
    manager, probe = cached_hybrid(make_manager, full_spec(4), sliding_spec(9, block_size=8),
                                   num_tokens=20)
    assert manager.block_size == 4
    # 20 tokens: full blocks 1..5, sliding blocks 6..8.
    hit, num_hit = manager.get_computed_blocks(probe)
    assert (hit.get_block_ids(), num_hit) == (([1, 2, 3, 4], [0, 7]), 16)
    manager.evict_blocks({4})  # full hit is 12 tokens, which is not a multiple of 8
    hit, num_hit = manager.get_computed_blocks(probe)
    assert (hit.get_block_ids(), num_hit) == (([1, 2], [6]), 8)
