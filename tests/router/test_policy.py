"""Routing policies over a real index and instance states (no processes)."""

import pytest

from kvtier.router.config import RouterConfig
from kvtier.router.index import KVIndex
from kvtier.router.instances import Instance
from kvtier.router.policy import NoInstanceError, Router

BLOCK = 16
PROMPT = [101, 102, 103, 104]


def make(policy="kv-aware", saturation=4, load_weight_tokens=16):
    config = RouterConfig(instances=("http://a:1", "http://b:1", "http://c:1"), policy=policy,
                          saturation=saturation, load_weight_tokens=load_weight_tokens)
    instances = [Instance(url, slot, healthy=True, indexed=True)
                 for slot, url in enumerate(config.instances, start=1)]
    return Router(config, instances, KVIndex(1000)), instances


def test_kv_aware_sends_a_prompt_where_its_prefix_is_cached():
    router, (a, b, c) = make()
    router.index.store(b.slot, PROMPT[:3], "GPU")
    router.index.store(c.slot, PROMPT[:2], "GPU")
    decision = router.choose(PROMPT, BLOCK)
    assert (decision.instance, decision.reason, decision.predicted_cached_tokens) == \
        (b, "cache_hit", 3 * BLOCK)
    # Load is weighed against cached tokens: 2 requests (32 tokens) outweigh one block.
    b.in_flight = 2
    assert router.choose(PROMPT, BLOCK).instance is c


def test_kv_aware_stays_until_saturation_then_goes_elsewhere():
    router, (a, b, c) = make(load_weight_tokens=0)
    router.index.store(b.slot, PROMPT, "GPU")
    b.in_flight = 3
    assert router.choose(PROMPT, BLOCK).instance is b
    b.reported_load = 4  # the instance's own count (other clients) is load too
    a.in_flight = 1
    decision = router.choose(PROMPT, BLOCK)
    assert (decision.instance, decision.reason, decision.predicted_cached_tokens) == \
        (c, "saturated", 0)


def test_without_a_hit_new_prompts_go_to_the_least_loaded_taking_turns():
    router, (a, b, c) = make()
    a.in_flight = 1
    chosen = [router.choose(PROMPT, BLOCK) for _ in range(4)]
    assert {d.reason for d in chosen} == {"no_hit"}
    assert [d.instance for d in chosen] in ([b, c, b, c], [c, b, c, b])


def test_unindexed_instances_have_no_hits_and_unhealthy_ones_get_nothing():
    router, (a, b, c) = make()
    router.index.store(a.slot, PROMPT, "GPU")
    a.indexed = False
    assert router.choose(PROMPT, BLOCK).reason == "no_hit"
    a.healthy = b.healthy = False
    assert router.choose(PROMPT, BLOCK).instance is c
    with pytest.raises(NoInstanceError):
        router.choose(PROMPT, BLOCK, exclude=frozenset({c.url}))


def test_round_robin_and_least_loaded():
    router, (a, b, c) = make("round-robin")
    assert [router.choose(PROMPT, BLOCK).instance for _ in range(4)] == [a, b, c, a]
    router, (a, b, c) = make("least-loaded")
    router.index.store(a.slot, PROMPT, "GPU")  # ignored by this policy
    a.in_flight, b.in_flight, c.in_flight = 2, 0, 1
    decision = router.choose(PROMPT, BLOCK)
    assert (decision.instance, decision.reason) == (b, "least_loaded")


def test_config_errors_name_the_option():
    with pytest.raises(ValueError, match="at least one --instance"):
        RouterConfig(instances=())
    with pytest.raises(ValueError, match="not an http"):
        RouterConfig(instances=("127.0.0.1:8000",))
    with pytest.raises(ValueError, match="distinct"):
        RouterConfig(instances=("http://a:1", "http://a:1"))
    with pytest.raises(ValueError, match="--policy must be one of"):
        RouterConfig(instances=("http://a:1",), policy="random")
    with pytest.raises(ValueError, match="--saturation must be >= 1"):
        RouterConfig(instances=("http://a:1",), saturation=0)
