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
    a.queued_tokens = 1
    decision = router.choose(PROMPT, BLOCK)
    assert (decision.instance, decision.reason, decision.predicted_cached_tokens,
            decision.prefill_tokens) == (c, "saturated", 0, len(PROMPT) * BLOCK)


def test_a_busy_holder_keeps_the_request_until_its_queue_costs_more_than_recomputing():
    """Cost = queued prefill tokens + 16 a request of load + the prompt's uncached tokens."""
    router, (a, b, c) = make(load_weight_tokens=16)
    prompt = list(range(8))  # 128 tokens, all cached on b's device
    router.index.store(b.slot, prompt, "GPU")
    c.in_flight = 1
    b.in_flight, b.queued_tokens = 1, 111  # 111 + 16 + 0 < 0 + 0 + 128 (a, idle)
    decision = router.choose(prompt, BLOCK, num_prompt_tokens=130)
    assert (decision.instance, decision.reason, decision.predicted_cached_tokens,
            decision.prefill_tokens) == (b, "cache_hit", 128, 2)
    b.queued_tokens = 115  # 115 + 16 + 2 > 0 + 0 + 130
    decision = router.choose(prompt, BLOCK, num_prompt_tokens=130)
    assert (decision.instance, decision.reason, decision.predicted_cached_tokens,
            decision.prefill_tokens) == (a, "busy", 0, 130)


def test_slower_tiers_save_less_so_their_holder_is_left_sooner():
    router, (a, b, c) = make(load_weight_tokens=0)
    prompt = list(range(8))
    router.index.store(b.slot, prompt, "CPU")  # host copies save 0.8 of their recompute
    router.index.store(c.slot, prompt, "STORAGE")  # disk copies 0.5
    decision = router.choose(prompt, BLOCK)
    assert (decision.instance, decision.reason, decision.prefill_tokens) == (b, "cache_hit", 26)
    b.queued_tokens = 40  # 40 + 25.6 > 64 on c's disk, < 128 recomputed on a
    decision = router.choose(prompt, BLOCK)
    assert (decision.instance, decision.reason, decision.prefill_tokens) == (c, "busy", 64)
    c.queued_tokens = 65
    assert router.choose(prompt, BLOCK).instance is b


def test_a_shared_store_counts_for_every_instance():
    router, (a, b, c) = make(load_weight_tokens=0)
    prompt = list(range(8))
    router.index.store(a.slot, prompt, "STORAGE", locality="remote")
    a.queued_tokens, b.queued_tokens = 10, 5
    decision = router.choose(prompt, BLOCK)
    # 0.3 of each block saved wherever the request goes: the shortest queue wins.
    assert (decision.instance, decision.reason, decision.predicted_cached_tokens,
            decision.prefill_tokens) == (c, "cache_hit", 128, 90)


def test_new_prompts_go_where_the_least_prefill_waits_not_the_fewest_requests():
    router, (a, b, c) = make(load_weight_tokens=16)
    a.in_flight = 3  # past their first tokens: decoding
    b.in_flight, b.queued_tokens = 1, 600  # one long prompt still to compute
    c.in_flight, c.queued_tokens = 2, 40
    decision = router.choose(PROMPT, BLOCK)
    assert (decision.instance, decision.reason) == (a, "no_hit")


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


def test_new_conversations_take_turns_whatever_their_later_turns_decided():
    """Sequential conversations of as many turns as there are instances: when every decision
    counted a turn, each new one came back to the same instance."""
    router, instances = make()
    starts = []
    for conversation in range(3):
        prompt = [1000 * (conversation + 1) + i for i in range(4)]
        first = router.choose(prompt, BLOCK).instance
        starts.append(first)
        router.index.store(first.slot, prompt, "GPU")
        for _ in range(2):  # later turns: a cache hit, no tie
            assert router.choose(prompt, BLOCK).instance is first
    assert sorted(i.slot for i in starts) == [i.slot for i in instances]
