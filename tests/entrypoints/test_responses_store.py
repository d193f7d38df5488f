"""The responses store: bounded in bytes, least recently used first out."""

from kvtier.entrypoints.openai.responses.store import ResponseStore, StoredResponse


def stored(text: str) -> StoredResponse:
    return StoredResponse({"id": text}, [{"role": "user", "content": text}], [])


def test_the_least_recently_used_goes_first_when_room_is_needed():
    one = stored("a" * 100)
    store = ResponseStore(3 * one.num_bytes)
    for name in ("r1", "r2", "r3"):
        assert store.put(name, stored("a" * 100))
    assert store.get("r1") is not None  # r2 is now the least recently used
    store.put("r4", stored("a" * 100))
    assert [name for name in ("r1", "r2", "r3", "r4") if store.get(name)] == ["r1", "r3", "r4"]
    assert store.num_bytes == 3 * one.num_bytes


def test_one_larger_than_the_bound_is_not_kept_and_drops_nothing():
    store = ResponseStore(stored("s").num_bytes + 100)
    assert store.put("small", stored("s"))
    assert not store.put("big", stored("b" * 500))
    assert store.get("big") is None and store.get("small") is not None


def test_replacing_and_deleting_keep_the_byte_count():
    store = ResponseStore(10_000)
    store.put("r", stored("x" * 50))
    store.put("r", stored("x" * 10))
    assert store.num_bytes == stored("x" * 10).num_bytes and len(store) == 1
    assert store.delete("r") and not store.delete("r")
    assert store.num_bytes == 0


def test_a_zero_bound_keeps_nothing():
    store = ResponseStore(0)
    assert not store.put("r", stored("x"))
    assert len(store) == 0


def test_the_bound_counts_what_python_holds_not_only_the_json():
    """Many small messages take ~5x their JSON size in Python objects: the bound counts
    those (a bound on JSON bytes alone let the store hold five times its size)."""
    import json
    import tracemalloc

    messages = [{"role": "user", "content": f"m{i}"} for i in range(2000)]
    blob = json.dumps([{"id": "r"}, messages, []])
    tracemalloc.start()
    parsed = json.loads(blob)
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    estimate = StoredResponse(*parsed).num_bytes
    assert len(blob) * 3 < held <= estimate < 1.5 * held
