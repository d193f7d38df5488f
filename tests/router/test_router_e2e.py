"""The router in front of three real instances: conversations stay where their prefix is, the
index follows evictions, hashes agree with the engine's, and a killed instance costs no client
an error. Slow: three model servers start (minutes on a busy 2-core machine)."""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import zmq

from kvtier.router.prompts import CHAT_PATH, PromptHasher, load_tokenizer
from kvtier.router.proxy import INSTANCE_HEADER

from .conftest import BLOCK_SIZE

pytestmark = pytest.mark.slow

TIMEOUT_S = 120.0
# Events reach the router within milliseconds; this bounds the wait on a loaded machine.
EVENT_DEADLINE_S = 10.0


def chat(url: str, model: str, messages: list[dict], **extra) -> httpx.Response:
    response = httpx.post(f"{url}{CHAT_PATH}", timeout=TIMEOUT_S, json={
        "model": model, "messages": messages, "max_tokens": 8, "temperature": 0, **extra})
    assert response.status_code == 200, response.text
    return response


def conversation(topic: str) -> list[dict]:
    """A first turn whose first block already differs from other topics' (no shared prefix)."""
    return [{"role": "user", "content": f"{topic}: tell me all about it, slowly. " * 2}]


def router_metric(router, name: str) -> float:
    text = httpx.get(f"{router.url}/metrics", timeout=5.0).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def wait_for(value, expected, what: str) -> None:
    """Until value() == expected (the router's index catches up on events)."""
    deadline = time.monotonic() + EVENT_DEADLINE_S
    while (got := value()) != expected:
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {got} != {expected}"
        time.sleep(0.05)


def test_router_and_engine_agree_on_every_block_hash(cluster, router_model):
    router, instances = cluster
    info = httpx.get(f"{instances[0].url}/v1/kv_events_info", timeout=5.0).json()
    assert (info["publishing"], info["block_size"]) == (True, BLOCK_SIZE)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(info["endpoint"])
    time.sleep(0.5)  # let the subscription reach the PUB socket
    hasher = PromptHasher(load_tokenizer(info["model"]), BLOCK_SIZE, info["hash_algo"])
    bodies = [(CHAT_PATH, {"model": router_model, "messages": conversation("hash agreement")}),
              ("/v1/completions", {"model": router_model, "prompt": "agree " * 40}),
              ("/v1/completions", {"model": router_model, "prompt": "agree " * 40,
                                   "cache_salt": "tenant-7"})]
    try:
        for path, body in bodies:
            response = httpx.post(f"{instances[0].url}{path}", timeout=TIMEOUT_S,
                                  json={**body, "max_tokens": 1})
            assert response.status_code == 200, response.text
            stored = _stored_gpu_hashes(sub)
            expected = hasher.block_hashes_of(hasher.token_ids(path, body),
                                              body.get("cache_salt"))
            assert len(expected) >= 4 and stored[:len(expected)] == expected
    finally:
        sub.close(linger=0)


def _stored_gpu_hashes(sub) -> list[int]:
    """The hashes of the next BlockStored events on the device, in order."""
    assert sub.poll(int(EVENT_DEADLINE_S * 1000)), "no KV events arrived"
    from kvtier.events import BlockStored, decode_batch

    hashes: list[int] = []
    while sub.poll(300):
        batch = decode_batch(sub.recv_multipart()[2])
        for event in batch.events:
            if isinstance(event, BlockStored) and event.medium == "GPU":
                hashes.extend(event.block_hashes)
    return hashes


def test_later_turns_land_where_the_prefix_is(cluster, router_model):
    router, _ = cluster
    served: dict[str, set[str]] = {}
    for topic in ("caches", "tiers", "events"):
        messages = conversation(topic)
        for turn in range(3):
            response = chat(router.url, router_model, messages)
            served.setdefault(topic, set()).add(response.headers[INSTANCE_HEADER])
            if turn:
                cached = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert cached >= BLOCK_SIZE, (topic, turn, cached)
            messages = messages + [response.json()["choices"][0]["message"],
                                   {"role": "user", "content": f"And then what? ({turn})"}]
    assert all(len(urls) == 1 for urls in served.values()), served
    # New conversations spread over idle instances instead of piling on one.
    assert len(set.union(*served.values())) > 1, served
    assert router_metric(router, "kvtier_router:decisions_total{policy=\"kv-aware\","
                                 "reason=\"cache_hit\"}") >= 6
    assert router_metric(router, "kvtier_router:actual_cached_tokens_total") > 0


def explain(router, model: str, messages: list[dict]) -> dict:
    response = httpx.post(f"{router.url}/router/explain", timeout=TIMEOUT_S, json={
        "path": CHAT_PATH, "body": {"model": model, "messages": messages}})
    assert response.status_code == 200, response.text
    return response.json()


def cached_on(explained: dict) -> dict[str, tuple[int, float]]:
    """url -> (cached blocks, tier-weighted blocks) of the explained prompt."""
    return {i["url"]: (i["cached_blocks"], round(i["weighted_blocks"], 6))
            for i in explained["instances"]}


def test_index_follows_eviction_to_where_the_prefix_still_lives(cluster, router_model):
    router, instances = cluster
    messages = conversation("eviction")
    holder_url = chat(router.url, router_model, messages).headers[INSTANCE_HEADER]
    holder = next(i for i in instances if i.url == holder_url)
    other = next(i for i in instances if i.url != holder_url)
    num_blocks = explain(router, router_model, messages)["num_prompt_blocks"]
    wait_for(lambda: cached_on(explain(router, router_model, messages))[holder.url],
             (num_blocks, num_blocks), "the prefix on the holder's device")
    # The holder's device cache fills with other prompts: the conversation's blocks leave
    # its device memory, and only its host tier keeps them ("CPU", worth 0.8 a block).
    for topic in ("flood one", "flood two", "flood three", "flood four"):
        chat(holder.url, router_model, conversation(topic))
    wait_for(lambda: cached_on(explain(router, router_model, messages))[holder.url],
             (num_blocks, round(num_blocks * 0.8, 6)), "the index to see the device eviction")
    assert explain(router, router_model, messages)["instance"] == holder.url
    # The same prompt computed on another instance's device: that is where it now goes.
    chat(other.url, router_model, messages)
    wait_for(lambda: cached_on(explain(router, router_model, messages))[other.url],
             (num_blocks, num_blocks), "the prefix on the other device")
    explained = explain(router, router_model, messages)
    assert (explained["instance"], explained["reason"]) == (other.url, "cache_hit")
    assert chat(router.url, router_model, messages).headers[INSTANCE_HEADER] == other.url


def test_a_killed_instance_costs_no_client_an_error(cluster, router_model):
    router, instances = cluster
    victim = instances[0]
    results: list[int] = []
    errors: list[BaseException] = []

    def client(index: int) -> None:
        try:
            for turn in range(4):
                messages = conversation(f"kill test {index} {turn}")
                response = httpx.post(f"{router.url}{CHAT_PATH}", timeout=TIMEOUT_S, json={
                    "model": router_model, "messages": messages, "max_tokens": 24,
                    "temperature": 0, "stream": turn % 2 == 1})
                results.append(response.status_code)
        except BaseException as exc:  # surfaced by the main thread's assert
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    # Frozen first, so requests are surely in flight on it when it dies.
    victim.process.send_signal(signal.SIGSTOP)
    time.sleep(1.0)
    victim.process.kill()
    for thread in threads:
        thread.join(TIMEOUT_S)
    assert not errors and results == [200] * 24, (errors, results)
    assert router_metric(router, "kvtier_router:retries_total") >= 1
    state = router.wait_until(lambda s: not s["instances"][0]["healthy"])
    assert [i["healthy"] for i in state["instances"]] == [False, True, True]
    # Requests after the kill go to the live instances only.
    with ThreadPoolExecutor(4) as pool:
        urls = list(pool.map(lambda i: chat(router.url, router_model,
                                            conversation(f"after {i}")).headers[INSTANCE_HEADER],
                             range(4)))
    assert victim.url not in urls
    assert json.loads(httpx.get(f"{router.url}/router/instances").text)["index_blocks"] > 0
