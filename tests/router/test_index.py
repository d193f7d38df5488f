"""The KV index: tiers per instance, shared stores, removals, clears, its LRU bound."""

from kvtier.router.config import TierWeights
from kvtier.router.index import KVIndex, PrefixMatch

A, B = 1, 2


def test_a_prefix_counts_until_the_first_block_an_instance_lacks():
    index = KVIndex(100)
    index.store(A, [10, 11, 12], "GPU")
    index.store(B, [10, 11], "CPU")
    assert index.match([10, 11, 12, 13], [A, B]) == {A: PrefixMatch(3, 3.0),
                                                     B: PrefixMatch(2, 1.6)}
    # Block 10 missing from A breaks A's prefix even though A holds 11 and 12.
    index.remove(A, [10], "GPU")
    assert index.match([10, 11, 12], [A, B]) == {A: PrefixMatch(0, 0.0), B: PrefixMatch(2, 1.6)}


def test_the_best_tier_of_a_block_decides_its_weight():
    index = KVIndex(100, TierWeights(gpu=1.0, cpu=0.5, disk=0.25, remote=0.125))
    index.store(A, [1, 2], "STORAGE")
    index.store(A, [1], "CPU")
    assert index.match([1, 2], [A]) == {A: PrefixMatch(2, 0.75)}
    index.store(A, [2], "GPU")
    assert index.match([1, 2], [A]) == {A: PrefixMatch(2, 1.5)}
    index.remove(A, [1], "CPU")  # the disk copy is left
    assert index.match([1, 2], [A]) == {A: PrefixMatch(2, 1.25)}
    index.store(B, [1], "obj")  # a local tier with another name
    assert index.match([1], [B]) == {B: PrefixMatch(1, 0.125)}


def test_a_shared_store_counts_for_every_instance():
    index = KVIndex(100, TierWeights(remote=0.25))
    index.store(A, [1, 2], "STORAGE", locality="remote")
    index.store(B, [1], "GPU")
    assert index.match([1, 2], [A, B, 3]) == {A: PrefixMatch(2, 0.5), B: PrefixMatch(2, 1.25),
                                              3: PrefixMatch(2, 0.5)}
    index.remove(B, [2], "STORAGE", locality="remote")  # gone from the store, for everyone
    assert index.match([1, 2], [A]) == {A: PrefixMatch(1, 0.25)}


def test_clear_forgets_one_instance_or_one_medium():
    index = KVIndex(100)
    index.store(A, [1, 2], "GPU")
    index.store(A, [1], "CPU")
    index.store(B, [1, 2], "GPU")
    index.clear(A, "GPU")
    assert index.match([1, 2], [A, B]) == {A: PrefixMatch(1, 0.8), B: PrefixMatch(2, 2.0)}
    index.clear(B)
    assert index.match([1, 2], [A, B]) == {A: PrefixMatch(1, 0.8), B: PrefixMatch(0, 0.0)}
    assert len(index) == 1  # block 2 is held by nobody: gone


def test_the_index_keeps_the_most_recently_stored_blocks_within_its_bound():
    index = KVIndex(3)
    index.store(A, [1, 2, 3], "GPU")
    index.store(B, [1], "GPU")  # stored again: now the most recent
    index.store(A, [4, 5], "GPU")
    assert (len(index), index.num_evicted) == (3, 2)
    assert index.match([1], [A, B]) == {A: PrefixMatch(1, 1.0), B: PrefixMatch(1, 1.0)}
    assert index.match([2], [A]) == {A: PrefixMatch(0, 0.0)}
    # Many instances pack into one entry per block.
    for slot in range(1, 40):
        index.store(slot, [1], "GPU")
    assert index.match([1], [39]) == {39: PrefixMatch(1, 1.0)} and len(index) == 3
