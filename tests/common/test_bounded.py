from kvtier.common.bounded import BoundedDict


def test_past_its_bound_the_least_recently_set_key_is_forgotten():
    counts = BoundedDict(3)
    for key in "abc":
        counts[key] = 1
    counts["a"] = 2  # set again: now the most recent
    counts["d"] = 1
    assert list(counts) == ["c", "a", "d"]
    assert counts["a"] == 2 and "b" not in counts
    assert counts.pop("c") == 1 and len(counts) == 2
