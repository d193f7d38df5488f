from kvtier.offload.policies import ARCPolicy, LRUPolicy, make_policy


def _always(_key):
    return True


def _run(policy, trace):
    """Drive `policy` like a full cache of its capacity; return the victims in order."""
    resident: set[str] = set()
    victims = []
    for op, key in trace:
        if op == "touch":
            policy.touch(key)
            continue
        if len(resident) == policy.capacity:
            victim = policy.pop_victim(key, _always)
            victims.append(victim)
            resident.remove(victim)
        policy.insert(key)
        resident.add(key)
    return victims


# a, b resident; a used again; then c, the just-evicted b, and d arrive.
_TRACE = [("insert", "a"), ("insert", "b"), ("touch", "a"), ("insert", "c"), ("insert", "b"),
          ("insert", "d")]


def test_lru_victim_order():
    assert _run(LRUPolicy(2), _TRACE) == ["b", "a", "c"]


def test_arc_victim_order_and_adaptation():
    arc = ARCPolicy(2)
    # b (seen once) goes first; c (seen once) before a (seen twice); b's ghost hit grows T1's
    # target; d's arrival then evicts from T2 because T1 is empty.
    assert _run(arc, _TRACE) == ["b", "c", "a"]
    assert arc.p == 1
    assert list(arc.t1) == ["d"] and list(arc.t2) == ["b"]
    assert list(arc.b1) == ["c"] and list(arc.b2) == ["a"]


def test_arc_resists_a_scan_that_flushes_lru():
    # Two hot keys used twice, then a scan of one-off keys; ARC keeps the hot keys.
    hot = [("insert", "h1"), ("insert", "h2"), ("touch", "h1"), ("touch", "h2")]
    scan = [("insert", f"s{i}") for i in range(6)]
    arc, lru = ARCPolicy(3), LRUPolicy(3)
    arc_victims = _run(arc, hot + scan)
    lru_victims = _run(lru, hot + scan)
    assert arc_victims == ["s0", "s1", "s2", "s3", "s4"]
    assert lru_victims == ["h1", "h2", "s0", "s1", "s2"]


def test_protected_keys_are_skipped():
    for policy in (LRUPolicy(3), ARCPolicy(3)):
        for key in "abc":
            policy.insert(key)
        assert policy.pop_victim("d", lambda key: key != "a") == "b"
        assert policy.pop_victim("d", lambda key: key == "zzz") is None
        assert len(policy) == 2


def test_make_policy_by_name():
    assert isinstance(make_policy("arc", 4), ARCPolicy)
    assert isinstance(make_policy("lru", 4), LRUPolicy)
