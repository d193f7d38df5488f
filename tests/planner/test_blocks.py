"""Block identities of trace prompts: equal hash-id prefixes give equal blocks, chained."""

import pytest

from kvtier.planner.blocks import BlockKeys


def test_equal_prefixes_share_blocks_and_the_chain_tells_parents_apart():
    keys = BlockKeys(tokens_per_block=8, block_size=4)
    first = keys.prompt_keys((0, 1, 2), 24)
    second = keys.prompt_keys((0, 1, 3), 24)
    assert len(first) == 6 and len(set(first)) == 6
    assert first[:4] == second[:4] and set(first[4:]).isdisjoint(second[4:])
    # Hash id 1 after another first block is another block (the engine chains its hashes).
    assert set(keys.prompt_keys((9, 1), 16)[2:]).isdisjoint(first)
    assert keys.num_distinct == 6 + 2 + 4


def test_partial_last_hash_id_holds_a_prefix_of_its_blocks():
    keys = BlockKeys(tokens_per_block=16, block_size=4)
    partial = keys.prompt_keys((5, 6), 16 + 9)  # 9 tokens of hash id 6: 2 full blocks
    full = keys.prompt_keys((5, 6), 32)
    assert len(partial) == 6 and full[:6] == partial and len(full) == 8
    assert keys.num_distinct == 8


def test_tokens_per_block_must_be_whole_engine_blocks():
    with pytest.raises(ValueError, match="multiple of the engine's block size"):
        BlockKeys(tokens_per_block=10, block_size=4)
