"""KVCacheManager scenarios with exact block ids, eviction orders and hit lengths.

Pools have 11 blocks unless said otherwise: block 0 is the null block, 1..10 are handed out
from the head of the free queue in id order on a fresh pool. Block size 4.
"""

from __future__ import annotations

import pytest

from kvtier.kv import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheBlocks, RequestStatus

from .kv_helpers import admit, full_spec, make_request, sliding_spec


def free_queue_ids(manager) -> list[int]:
    return [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]


def snapshot(manager) -> tuple:
    pool = manager.block_pool
    return (free_queue_ids(manager),
            [(b.ref_cnt, b.cache_key) for b in pool.blocks],
            sorted((k[0], k[1]) for k in pool.cached_block_hash_to_block),
            [{rid: [b.block_id for b in blocks] for rid, blocks in m.req_to_blocks.items()}
             for m in manager.coordinator.managers],
            [dict(m.num_cached_block) for m in manager.coordinator.managers])


def test_prefix_hit_is_capped_below_num_tokens_and_block_aligned(make_manager):
    manager = make_manager()
    first = make_request(manager, "a", list(range(12)))
    assert admit(manager, first)[0].get_block_ids() == ([1, 2, 3],)
    manager.free(first)

    same = make_request(manager, "b", list(range(12)))
    hit, num_hit = manager.get_computed_blocks(same)
    # 12 tokens all cached, but the last one must be recomputed: 11 -> aligned down to 8.
    assert (hit.get_block_ids(), num_hit) == (([1, 2],), 8)
    diverging = make_request(manager, "c", list(range(9)) + [99, 98, 97])
    assert manager.get_computed_blocks(diverging)[1] == 8
    longer = make_request(manager, "d", list(range(13)))
    assert manager.get_computed_blocks(longer) [0].get_block_ids() == ([1, 2, 3],)
    assert manager.get_computed_blocks(longer)[1] == 12
    one_block = make_request(manager, "e", list(range(4)))
    assert manager.get_computed_blocks(one_block)[1] == 0


def test_shared_prefix_ref_counts_and_tail_first_eviction(make_manager):
    manager = make_manager()
    a = make_request(manager, "a", list(range(12)))
    admit(manager, a)
    b = make_request(manager, "b", list(range(8)) + [50, 51, 52, 53, 60, 61])
    blocks, num_hit = admit(manager, b)
    assert num_hit == 8
    assert blocks.get_block_ids() == ([4, 5],)
    assert manager.get_block_ids("b") == ([1, 2, 4, 5],)
    assert [manager.block_pool.blocks[i].ref_cnt for i in range(1, 6)] == [2, 2, 1, 1, 1]

    manager.free(a)
    manager.free(b)
    # Each request frees last block first; shared blocks reach 0 only on the second free.
    assert free_queue_ids(manager) == [6, 7, 8, 9, 10, 3, 5, 4, 2, 1]
    c = make_request(manager, "c", [100 + i for i in range(24)])
    assert admit(manager, c)[0].get_block_ids() == ([6, 7, 8, 9, 10, 3],)
    probe = make_request(manager, "p", list(range(13)))
    # a's tail (block 3) went first; the shared head [1, 2] survives.
    assert manager.get_computed_blocks(probe)[0].get_block_ids() == ([1, 2],)
    manager.free(c)


def test_least_recently_freed_request_is_evicted_first(make_manager):
    manager = make_manager()
    a = make_request(manager, "a", list(range(9)))
    b = make_request(manager, "b", list(range(20, 29)))
    admit(manager, a)
    admit(manager, b)
    manager.free(a)
    manager.free(b)
    assert free_queue_ids(manager) == [7, 8, 9, 10, 3, 2, 1, 6, 5, 4]
    c = make_request(manager, "c", [100 + i for i in range(24)])
    assert admit(manager, c)[0].get_block_ids() == ([7, 8, 9, 10, 3, 2],)
    assert manager.get_computed_blocks(make_request(manager, "a2", list(range(9))))[1] == 4
    assert manager.get_computed_blocks(make_request(manager, "b2", list(range(20, 29))))[1] == 8
    manager.free(c)


def test_touched_blocks_survive_eviction(make_manager):
    manager = make_manager()
    a = make_request(manager, "a", list(range(9)))
    admit(manager, a)
    manager.free(a)
    b = make_request(manager, "b", list(range(9)))
    assert admit(manager, b) [0].get_block_ids() == ([4],)
    assert manager.get_block_ids("b") == ([1, 2, 4],)
    c = make_request(manager, "c", [100 + i for i in range(28)])
    assert admit(manager, c)[0].get_block_ids() == ([5, 6, 7, 8, 9, 10, 3],)
    assert manager.num_free_blocks == 0
    manager.free(b)
    manager.free(c)


def test_null_block_is_never_handed_out(make_manager):
    manager = make_manager()
    a = make_request(manager, "a", [7] * 40)
    assert admit(manager, a)[0].get_block_ids() == (list(range(1, 11)),)
    assert manager.usage == 1.0
    b = make_request(manager, "b", [8] * 4)
    assert manager.allocate_slots(b, 4) is None
    with pytest.raises(ValueError, match="only 0 are free"):
        manager.block_pool.get_new_blocks(1)
    manager.free(a)
    assert manager.usage == 0.0


def test_refused_allocation_leaves_state_unchanged(make_manager):
    manager = make_manager()
    a = make_request(manager, "a", list(range(12)))
    admit(manager, a)
    manager.free(a)
    big = make_request(manager, "big", list(range(8)) + [9] * 40)
    hit, num_hit = manager.get_computed_blocks(big)
    assert num_hit == 8
    before = snapshot(manager)
    assert manager.allocate_slots(big, big.num_tokens - 8, num_hit, hit) is None
    assert snapshot(manager) == before


def test_refused_sliding_window_allocation_keeps_its_skippable_blocks(make_manager):
    manager = make_manager(7, sliding_spec(window=5))
    r = make_request(manager, "r", list(range(12)))
    admit(manager, r)
    before = snapshot(manager)
    # The skip would free blocks 1 and 2, but 40 more tokens never fit: nothing may change.
    assert manager.allocate_slots(r, 40) is None
    assert snapshot(manager) == before
    assert manager.allocate_slots(r, 8).get_block_ids() == ([4, 5],)
    assert manager.get_block_ids("r") == ([0, 0, 3, 4, 5],)
    manager.free(r)


def test_watermark_applies_only_to_waiting_and_preempted(make_manager):
    manager = make_manager(101, watermark=0.1)  # 10 watermark blocks, 100 usable
    assert manager.watermark_blocks == 10
    first = make_request(manager, "first", [1] * 300)
    # Nobody else holds blocks, so the newcomer is not held back by the watermark.
    assert admit(manager, first)[0] is not None
    assert manager.num_free_blocks == 25
    waiting = make_request(manager, "w", [2] * 64)  # 16 blocks: 16 + 10 > 25
    assert manager.allocate_slots(waiting, 64) is None
    waiting.status = RequestStatus.PREEMPTED
    assert manager.allocate_slots(waiting, 64) is None
    waiting.status = RequestStatus.RUNNING
    assert len(manager.allocate_slots(waiting, 64).blocks[0]) == 16
    manager.free(first)
    manager.free(waiting)


def test_full_sequence_must_fit_refuses_admission(make_manager):
    manager = make_manager()
    holder = make_request(manager, "h", [1] * 16)
    admit(manager, holder)  # 4 blocks held, 6 free
    long_prompt = make_request(manager, "long", [2] * 32)  # needs 8 blocks in total
    assert manager.allocate_slots(long_prompt, 4, full_sequence_must_fit=True) is None
    assert manager.allocate_slots(long_prompt, 4).get_block_ids() == ([5],)
    manager.free(holder)
    manager.free(long_prompt)


def test_reserved_blocks_refuse_allocation(make_manager):
    manager = make_manager()
    r = make_request(manager, "r", [3] * 12)
    assert manager.allocate_slots(r, 12, reserved_blocks=8) is None
    assert manager.allocate_slots(r, 12, reserved_blocks=7).get_block_ids() == ([1, 2, 3],)
    manager.free(r)


def test_blocks_to_finish_prefill_count_what_a_loading_request_still_needs(make_manager):
    manager = make_manager()  # block size 4
    loading = make_request(manager, "load", list(range(18)))  # 5 blocks in all
    assert manager.num_blocks_to_finish_prefill(loading) == 5
    manager.allocate_slots(loading, 0, num_external_computed_tokens=8, delay_cache_blocks=True)
    loading.num_computed_tokens = 8  # as the scheduler sets it for the load
    assert manager.get_block_ids("load") == ([1, 2],)
    assert manager.num_blocks_to_finish_prefill(loading) == 3
    manager.free(loading)


def test_delayed_caching_gives_no_hit_until_cache_blocks(make_manager):
    manager = make_manager()
    loading = make_request(manager, "load", list(range(9)))
    blocks = manager.allocate_slots(loading, 0, num_external_computed_tokens=8,
                                    delay_cache_blocks=True)
    assert blocks.get_block_ids() == ([1, 2],)
    other = make_request(manager, "other", list(range(9)))
    assert manager.get_computed_blocks(other)[1] == 0
    manager.cache_blocks(loading, 8)
    hit, num_hit = manager.get_computed_blocks(other)
    assert (hit.get_block_ids(), num_hit) == (([1, 2],), 8)
    manager.free(loading)


def test_external_tokens_then_new_tokens(make_manager):
    manager = make_manager()
    a = make_request(manager, "a", list(range(8)))
    admit(manager, a)
    manager.free(a)
    r = make_request(manager, "r", list(range(17)))
    hit, num_hit = manager.get_computed_blocks(r)
    assert num_hit == 8
    blocks = manager.allocate_slots(r, 1, num_hit, hit, num_external_computed_tokens=8)
    # Local hit [1, 2]; external tokens 8..15 and the new token 16 get fresh blocks.
    assert blocks.get_block_ids() == ([3, 4, 5],)
    assert manager.get_block_ids("r") == ([1, 2, 3, 4, 5],)
    manager.free(r)


def test_reset_prefix_cache_refused_in_use_then_clears_every_hash(make_manager):
    manager = make_manager(enable_kv_cache_events=True)
    r = make_request(manager, "r", list(range(12)))
    admit(manager, r)
    manager.take_events()
    assert manager.reset_prefix_cache() is False
    manager.free(r)
    assert manager.reset_prefix_cache() is True
    assert manager.block_pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in manager.block_pool.blocks)
    assert manager.take_events() == [AllBlocksCleared()]
    assert manager.get_computed_blocks(make_request(manager, "s", list(range(12))))[1] == 0
    assert manager.make_prefix_cache_stats().reset is True


def test_pop_blocks_for_free_keeps_blocks_allocated(make_manager):
    manager = make_manager()
    r = make_request(manager, "r", list(range(12)))
    admit(manager, r)
    popped = manager.pop_blocks_for_free(r)
    assert [b.block_id for b in popped] == [3, 2, 1]
    assert manager.get_block_ids("r") == ([],)
    assert manager.num_free_blocks == 7
    assert [b.ref_cnt for b in popped] == [1, 1, 1]
    manager.check_invariants(active_request_ids=set())
    manager.free_popped_blocks(popped)
    assert free_queue_ids(manager) == [4, 5, 6, 7, 8, 9, 10, 3, 2, 1]
    with pytest.raises(ValueError, match="was not popped"):
        manager.free_popped_blocks(popped)


def test_cache_salt_isolates_tenants(make_manager):
    manager = make_manager()
    tokens = list(range(9))
    tenant_a = make_request(manager, "a", tokens, cache_salt="tenant-a")
    admit(manager, tenant_a)
    assert manager.get_computed_blocks(make_request(manager, "b", tokens,
                                                    cache_salt="tenant-b"))[1] == 0
    assert manager.get_computed_blocks(make_request(manager, "n", tokens))[1] == 0
    assert manager.get_computed_blocks(make_request(manager, "a2", tokens,
                                                    cache_salt="tenant-a"))[1] == 8
    manager.free(tenant_a)


def test_events_carry_parent_hashes_and_group_metadata(make_manager):
    manager = make_manager(11, full_spec(), enable_kv_cache_events=True)
    r = make_request(manager, "r", list(range(9)))
    admit(manager, r)
    h = r.block_hashes
    assert manager.take_events() == [BlockStored(
        block_hashes=[h[0], h[1]], parent_block_hash=None, token_ids=list(range(8)),
        block_size=4, lora_id=None, medium="device", group_idx=0, kind="full_attention")]
    for token in (9, 10, 11):
        r.append_output_token_ids(token)  # sampled last step, computed this step
        manager.allocate_slots(r, 1)
        r.num_computed_tokens += 1
    assert manager.take_events() == [BlockStored(
        block_hashes=[h[2]], parent_block_hash=h[1], token_ids=[8, 9, 10, 11], block_size=4,
        lora_id=None, medium="device", group_idx=0, kind="full_attention")]
    manager.free(r)
    filler = make_request(manager, "f", [500 + i for i in range(40)])
    admit(manager, filler)
    assert manager.take_events() == [
        BlockRemoved(block_hashes=[h[2]], medium="device", group_idx=0, kind="full_attention"),
        BlockRemoved(block_hashes=[h[1]], medium="device", group_idx=0, kind="full_attention"),
        BlockRemoved(block_hashes=[h[0]], medium="device", group_idx=0, kind="full_attention"),
        BlockStored(block_hashes=filler.block_hashes, parent_block_hash=None,
                    token_ids=list(range(500, 540)), block_size=4, lora_id=None,
                    medium="device", group_idx=0, kind="full_attention")]
    manager.free(filler)


def test_events_of_sliding_window_group_name_the_window(make_manager):
    manager = make_manager(11, sliding_spec(window=8), enable_kv_cache_events=True)
    r = make_request(manager, "r", list(range(5)), lora_name="adapter")
    admit(manager, r)
    (event,) = manager.take_events()
    assert (event.kind, event.sliding_window, event.lora_id) == ("sliding_window", 8, "adapter")
    manager.free(r)


def test_decode_blocks_become_cached_as_they_fill(make_manager):
    manager = make_manager()
    r = make_request(manager, "r", list(range(6)))
    admit(manager, r)
    for token in (6, 7, 8):
        r.append_output_token_ids(token)  # sampled last step, computed this step
        manager.allocate_slots(r, 1)
        r.num_computed_tokens += 1
    manager.free(r)
    again = make_request(manager, "again", list(range(9)))
    assert manager.get_computed_blocks(again)[0].get_block_ids() == ([1, 2],)


def test_prefix_cache_stats_count_tokens_and_reset(make_manager):
    manager = make_manager()
    a = make_request(manager, "a", list(range(12)))
    admit(manager, a)
    admit(manager, make_request(manager, "b", list(range(10))))
    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 22, 8)
    assert manager.make_prefix_cache_stats().queries == 0
    manager.free(a)
    manager.free(make_request(manager, "b", []))


def test_prefix_cache_stats_count_a_waiting_request_once_per_start(make_manager):
    """A request asked again while it waits (a connector retry, no free blocks) is one lookup;
    after a preemption its next lookup counts apart, as a preempted one."""
    manager = make_manager()
    admit(manager, make_request(manager, "a", list(range(12))))
    b = make_request(manager, "b", list(range(10)))
    for _ in range(3):
        assert manager.get_computed_blocks(b)[1] == 8
    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 22, 8)
    b.num_preemptions += 1
    manager.get_computed_blocks(b)
    manager.get_computed_blocks(b)
    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.preempted_requests, stats.preempted_hits) == (0, 1, 8)


def test_caching_disabled_never_hits(make_manager):
    manager = make_manager(enable_caching=False)
    a = make_request(manager, "a", list(range(12)))
    admit(manager, a)
    manager.free(a)
    assert manager.block_pool.cached_block_hash_to_block == {}
    assert manager.get_computed_blocks(make_request(manager, "b", list(range(12))))[1] == 0


def test_skip_reading_prefix_cache(make_manager):
    manager = make_manager()
    a = make_request(manager, "a", list(range(12)))
    admit(manager, a)
    reader = make_request(manager, "b", list(range(12)), skip_reading_prefix_cache=True)
    assert manager.get_computed_blocks(reader) == (manager.empty_kv_cache_blocks, 0)
    manager.free(a)


def test_kv_cache_blocks_add_empty_and_unhashed(make_manager):
    manager = make_manager()
    a = make_request(manager, "a", list(range(12)))
    first = manager.allocate_slots(a, 8, delay_cache_blocks=True)
    a.num_computed_tokens = 8
    assert first.get_unhashed_block_ids() == [1, 2]
    second = manager.allocate_slots(a, 4)
    a.num_computed_tokens = 12
    assert (first + second).get_block_ids() == ([1, 2, 3],)
    # The second allocation cached every full block, the delayed ones included.
    assert manager.get_blocks("a").get_unhashed_block_ids() == []
    assert first.new_empty() == KVCacheBlocks(((),))
    assert first.new_empty().is_empty() and not first.is_empty()
    a.append_output_token_ids(12)
    assert manager.allocate_slots(a, 1).get_block_ids() == ([4],)
    a.num_computed_tokens = 13
    a.append_output_token_ids(13)
    assert manager.allocate_slots(a, 1) is manager.empty_kv_cache_blocks
    manager.free(a)


@pytest.mark.parametrize("kwargs, field", [
    ({"num_new_tokens": 0}, "num_new_tokens"),
    ({"num_new_tokens": -1}, "num_new_tokens"),
    ({"num_new_tokens": 1, "num_new_computed_tokens": -4}, "num_new_computed_tokens"),
    ({"num_new_tokens": 1, "num_lookahead_tokens": -1}, "num_lookahead_tokens"),
    ({"num_new_tokens": 1, "num_external_computed_tokens": -1},
     "num_external_computed_tokens"),
    ({"num_new_tokens": 1, "reserved_blocks": -1}, "reserved_blocks"),
])
def test_bad_allocate_arguments_name_the_field(make_manager, kwargs, field):
    manager = make_manager()
    with pytest.raises(ValueError, match=field):
        manager.allocate_slots(make_request(manager, "r", [1] * 4), **kwargs)


@pytest.mark.parametrize("kwargs, field", [
    ({"hash_algo": "md5"}, "hash_algo"),
    ({"max_model_len": 0}, "max_model_len"),
    ({"watermark": 1.5}, "watermark"),
])
def test_bad_manager_arguments_name_the_field(make_manager, kwargs, field):
    with pytest.raises(ValueError, match=field):
        make_manager(**kwargs)


def test_invariant_check_reports_leaked_requests(make_manager):
    manager = make_manager()
    r = make_request(manager, "r", [1] * 4)
    admit(manager, r)
    with pytest.raises(AssertionError, match=r"\['r'\] still hold KV state"):
        manager.check_invariants(active_request_ids=set())
    manager.block_pool.blocks[1].ref_cnt = 2
    with pytest.raises(AssertionError, match="block 1 has ref_cnt 2 but 1 holders"):
        manager.check_invariants()
    manager.block_pool.blocks[1].ref_cnt = 1
    manager.free(r)
