"""Per-type managers: sliding-window hit table and skip progression, Mamba last-state hits."""

from __future__ import annotations

import pytest

from .kv_helpers import admit, full_spec, make_request, mamba_spec, sliding_spec


def cache_eight_blocks_then_punch_holes(manager, holes: set[int]):
    """Cache blocks 0..7 of a 33-token prompt (block ids 1..8), free them, evict `holes`."""
    owner = make_request(manager, "owner", list(range(33)))
    admit(manager, owner)
    manager.free(owner)
    manager.evict_blocks({position + 1 for position in holes})
    return make_request(manager, "probe", list(range(33)))


@pytest.mark.parametrize("holes, expected_ids, expected_hit", [
    # Window 9, block 4: a hit needs the last cdiv(8, 4) = 2 blocks; the rest are null.
    (set(), [0, 0, 0, 0, 0, 0, 7, 8], 32),
    ({7}, [0, 0, 0, 0, 0, 6, 7], 28),
    ({5, 7}, [0, 0, 0, 4, 5], 20),
    ({1, 3, 5, 7}, [1], 4),  # no run of 2: the leading run from block 0
    ({0}, [0, 0, 0, 0, 0, 0, 7, 8], 32),
    ({0, 2, 4, 6}, [], 0),
])
def test_sliding_window_hit_table(make_manager, holes, expected_ids, expected_hit):
    manager = make_manager(11, sliding_spec(window=9))
    probe = cache_eight_blocks_then_punch_holes(manager, holes)
    probe.append_output_token_ids(99)  # 34 tokens: the cap num_tokens - 1 allows all 8 blocks
    hit, num_hit = manager.get_computed_blocks(probe)
    assert (hit.get_block_ids(), num_hit) == ((expected_ids,), expected_hit)


def test_sliding_window_hit_blocks_are_taken_and_counted(make_manager):
    manager = make_manager(11, sliding_spec(window=9))
    probe = cache_eight_blocks_then_punch_holes(manager, {7})
    hit, num_hit = manager.get_computed_blocks(probe)
    blocks = manager.allocate_slots(probe, probe.num_tokens - num_hit, num_hit, hit)
    # Hit of 28 tokens: its null positions take nothing, blocks 6 and 7 are touched, and the
    # 5 remaining tokens take 2 blocks from the head of the queue (the owner's tail, reversed).
    assert num_hit == 28
    assert blocks.get_block_ids() == ([10, 9],)
    assert manager.get_block_ids("probe") == ([0, 0, 0, 0, 0, 6, 7, 10, 9],)
    manager.free(probe)


def test_sliding_window_remove_skipped_blocks_progression(make_manager):
    manager = make_manager(11, sliding_spec(window=9))
    r = make_request(manager, "r", list(range(10)))
    admit(manager, r)
    tables = {}
    for token in range(10, 17):
        # Computing token n attends to [n - 8, n]; blocks wholly before n - 8 are dropped.
        tables[r.num_computed_tokens] = manager.get_block_ids("r")[0]
        manager.allocate_slots(r, 1)
        r.num_computed_tokens += 1
        r.append_output_token_ids(token)
    tables[r.num_computed_tokens] = manager.get_block_ids("r")[0]
    manager.allocate_slots(r, 1)
    assert tables == {10: [1, 2, 3], 11: [1, 2, 3], 12: [1, 2, 3], 13: [0, 2, 3, 4],
                      14: [0, 2, 3, 4], 15: [0, 2, 3, 4], 16: [0, 2, 3, 4], 17: [0, 0, 3, 4, 5]}
    # Dropped blocks return to the tail, oldest first, and keep their hashes for reuse.
    free_ids = [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]
    assert free_ids == [6, 7, 8, 9, 10, 1, 2]
    assert manager.block_pool.blocks[1].block_hash == r.block_hashes[0]
    manager.free(r)


def test_sliding_window_external_tokens_outside_window_get_null_blocks(make_manager):
    manager = make_manager(11, sliding_spec(window=5))
    r = make_request(manager, "r", list(range(17)))
    blocks = manager.allocate_slots(r, 1, num_external_computed_tokens=16,
                                    delay_cache_blocks=True)
    # Token 16 attends to [12, 16]: blocks 0..2 are never needed, so they are not allocated.
    assert blocks.get_block_ids() == ([0, 0, 0, 1, 2],)
    assert manager.num_free_blocks == 8
    manager.free(r)


def test_mamba_hit_is_the_last_cached_state(make_manager):
    manager = make_manager(11, mamba_spec())
    first = make_request(manager, "first", list(range(17)))
    admit(manager, first)
    manager.free(first)
    second = make_request(manager, "second", list(range(17)))
    hit, num_hit = manager.get_computed_blocks(second)
    assert (hit.get_block_ids(), num_hit) == (([0, 0, 0, 4],), 16)
    manager.evict_blocks({4})
    hit, num_hit = manager.get_computed_blocks(second)
    assert (hit.get_block_ids(), num_hit) == (([0, 0, 3],), 12)

    assert manager.allocate_slots(second, 5, num_hit, hit).get_block_ids() == ([6, 7],)
    assert manager.get_block_ids("second") == ([0, 0, 3, 6, 7],)
    second.num_computed_tokens = 17
    second.append_output_token_ids(17)
    manager.allocate_slots(second, 1)
    # Only the block holding the state after 17 tokens is kept.
    assert manager.get_block_ids("second") == ([0, 0, 0, 0, 7],)
    manager.free(second)


def test_a_rewind_resumes_only_where_every_group_still_holds_its_blocks(make_manager):
    manager = make_manager(20, full_spec(), mamba_spec(), sliding_spec(6))
    request = make_request(manager, "r", list(range(17)))
    admit(manager, request, 9)  # tokens 0..8
    assert manager.resumable_tokens(request, 8) == 8  # the state after 8 is block 1, held
    assert manager.allocate_slots(request, 8) is not None  # tokens 9..16
    request.num_computed_tokens = 17
    full, state, window = manager.get_block_ids("r")
    # Computing from 9 on dropped the states before block 2 and the window's block 0.
    assert (state[:2], window[:1]) == ([0, 0], [0])
    assert manager.resumable_tokens(request, 8) == 0  # the state after 8 is gone: start over
    assert manager.resumable_tokens(request, 16) == 16  # state block 3, window blocks 2-3
    assert manager.resumable_tokens(request, 12) == 12  # state block 2, window blocks 1-2
    assert manager.resumable_tokens(request, 14) == 0  # off a boundary no state is kept
    assert manager.resumable_tokens(request, 0) == 0
    manager.free(request)
    # Alone, a sliding window resumes where its window's blocks are still held.
    windowed = make_manager(20, full_spec(), sliding_spec(6))
    request = make_request(windowed, "w", list(range(17)))
    admit(windowed, request, 13)
    assert windowed.allocate_slots(request, 4) is not None  # drops blocks 0 and 1
    request.num_computed_tokens = 17
    # Token 12 attends 7..12 (block 1 is gone), token 16 attends 11..16 (blocks 2-3 held).
    assert [windowed.resumable_tokens(request, n) for n in (4, 12, 16)] == [0, 0, 16]
    windowed.free(request)


@pytest.mark.parametrize("state", [False, True])
def test_no_resume_where_the_recompute_would_write_null_blocks(make_manager, state):
    manager = make_manager(20, full_spec(), mamba_spec() if state else sliding_spec(8))
    group = manager.coordinator.managers[1]
    hit = manager.block_pool.get_new_blocks(2)  # blocks 1, 2: a hit of 8 tokens
    group.save_new_computed_blocks("r", hit, 8)
    # Slots for 36 tokens, 32 computed (24 of them loaded): a table with holes after the hit.
    group.allocate_new_blocks("r", 36, 32)
    table = [block.block_id for block in group.req_to_blocks["r"]]
    if state:  # only the latest state of the hit is kept
        assert table == [0, 2, 0, 0, 0, 0, 0, 3, 4]
    else:
        assert table == [1, 2, 0, 0, 0, 0, 3, 4, 5]
    # The window (or state) before token 8 is held, but recomputing 8..31 writes null blocks.
    assert [group.can_resume_at("r", n) for n in (8, 24, 28, 32)] == [False, False, False, True]
    group.free("r")
    manager.block_pool.free_blocks(hit)
