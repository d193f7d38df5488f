"""The router's P/D mode with real processes: a prefill and a decode `kvtier serve` (the
P2PConnector as producer and consumer, over loopback) and a `kvtier router --prefill --decode`
in front. Tokens equal HF's greedy ones (what one colocated instance gives), the decode instance
loads the prompts' KV instead of computing it, and a dead prefill instance costs no client an
error or a different token."""

from __future__ import annotations

import json
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from ..entrypoints.server_process import ServerProcess
from ..tiny_models import hf_greedy, make_block_prompts, make_hf_model, random_prompts
from .pd_cluster import (
    BLOCK_SIZE,
    GREEDY,
    MAX_TOKENS,
    TIMEOUT_S,
    complete,
    loaded_tokens,
    metric,
    serve_args,
    start_pd_router,
    token_ids,
    wait_until_idle,
)

NUM_CONCURRENT = 32


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    """(router, prefill, decode, hf model): started once for the module."""
    directory = str(tmp_path_factory.mktemp("pd_llama"))
    hf_model = make_hf_model("llama", directory, tokenizer="bytes")
    with ThreadPoolExecutor(2) as pool:
        starts = [pool.submit(ServerProcess, directory,
                              *serve_args("kv_producer", send_timeout_s=10.0)),
                  pool.submit(ServerProcess, directory, *serve_args("kv_consumer"))]
        prefill, decode = [start.result() for start in starts]
    router = None
    try:
        router = start_pd_router(directory, prefill.url, decode.url)
        yield router, prefill, decode, hf_model
    finally:
        if router is not None:
            router.stop()
        for server in (prefill, decode):
            server.stop()


def _complete_streamed(router, prompt: list[int]) -> tuple[list[int], dict]:
    """The streamed tokens and the usage of the last chunk."""
    tokens, usage = [], None
    with httpx.stream("POST", f"{router.url}/v1/completions", timeout=TIMEOUT_S,
                      json={"prompt": prompt, "stream": True,
                            "stream_options": {"include_usage": True}, **GREEDY}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: "):])
                tokens += [t for c in chunk["choices"] for t in c.get("token_ids") or []]
                usage = chunk.get("usage") or usage
    return tokens, usage


def test_pd_tokens_match_hf_and_the_decode_instance_loads_the_prompts(pd):
    router, prefill, decode, hf_model = pd
    for server, role in ((prefill, "kv_producer"), (decode, "kv_consumer")):
        info = httpx.get(f"{server.url}/v1/kv_transfer_info", timeout=5.0).json()
        assert (info["kv_connector"], info["kv_role"]) == ("P2PConnector", role)
        assert info["transport_address"].startswith("tcp://127.0.0.1:")
    state = router.state()["instances"]
    assert [(i["role"], i["transport_address"]) for i in state] == \
        [("prefill", None), ("decode", info["transport_address"])]
    prompts = make_block_prompts()
    expected = hf_greedy(hf_model, prompts, MAX_TOKENS)
    results = [complete(router.url, prompt) for prompt in prompts]
    assert token_ids(results) == expected
    # Every full block before the last token was the decode instance's without computing it:
    # loaded from the prefill instance, or (the third prompt shares the first's 3 blocks) from
    # its own prefix cache.
    assert [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in results] == \
        [loaded_tokens(p) for p in prompts]
    # (19, 16, 13, 23, 6 tokens) -> 4, 3, -, 5, 1 blocks over the transport.
    assert metric(decode.url, "kvtier:p2p_connector_blocks_loaded") == 13
    assert metric(decode.url, "vllm:prefix_cache_hits") == 3 * BLOCK_SIZE
    assert metric(router.url, 'kvtier_router:prefills_total{outcome="ok"}') == len(prompts)
    # The third prompt's transfer too: the decode instance takes it (and drops it) to free the
    # prefill instance's blocks.
    assert metric(prefill.url, "kvtier:p2p_connector_requests_sent") == len(prompts)


@pytest.mark.slow
def test_pd_streaming_and_chat_match_hf(pd):
    router, _, decode, hf_model = pd
    prompts = make_block_prompts(seed=1)
    expected = hf_greedy(hf_model, prompts, MAX_TOKENS)
    for prompt, tokens in zip(prompts, expected):
        streamed, usage = _complete_streamed(router, prompt)
        assert streamed == tokens
        assert usage["prompt_tokens_details"]["cached_tokens"] == loaded_tokens(prompt)
    response = httpx.post(f"{router.url}/v1/chat/completions", timeout=TIMEOUT_S, json={
        "messages": [{"role": "user", "content": "disaggregated " * 3}], **GREEDY})
    assert response.status_code == 200, response.text
    body = response.json()
    prompt_ids = body["prompt_token_ids"]
    assert body["choices"][0]["token_ids"] == hf_greedy(hf_model, [prompt_ids], MAX_TOKENS)[0]
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == loaded_tokens(prompt_ids)


@pytest.mark.faults
def test_pd_concurrent_requests_match_hf_and_leave_nothing_held(pd):
    """More requests than the decode instance's 64 blocks hold at once: some wait for room
    while the prefill instance holds their KV."""
    router, prefill, decode, hf_model = pd
    prompts = random_prompts(NUM_CONCURRENT, 21, seed=3)
    expected = hf_greedy(hf_model, prompts, MAX_TOKENS)
    sent = metric(prefill.url, "kvtier:p2p_connector_requests_sent")
    loaded = metric(decode.url, "kvtier:p2p_connector_blocks_loaded")
    with ThreadPoolExecutor(NUM_CONCURRENT) as pool:
        results = list(pool.map(lambda p: complete(router.url, p), prompts))
    assert token_ids(results) == expected
    assert all(r["usage"]["prompt_tokens_details"]["cached_tokens"] == 20 for r in results)
    # Every send ended and every request finished: no block, request or load is held on
    # either side, and the router has nothing in flight.
    for server in (prefill, decode):
        wait_until_idle(server.url)
    assert metric(prefill.url, "kvtier:p2p_connector_requests_sent") - sent == NUM_CONCURRENT
    assert metric(decode.url, "kvtier:p2p_connector_blocks_loaded") - loaded == \
        NUM_CONCURRENT * 5
    assert metric(prefill.url, "kvtier:p2p_connector_send_errors") == 0
    assert metric(decode.url, "kvtier:kv_load_failures") == 0
    assert metric(router.url, "kvtier_router:instance_in_flight") == 0


def test_pd_responses_load_their_prompt_and_go_on_where_they_are_stored(pd):
    router, prefill, decode, _ = pd
    prefills = metric(router.url, 'kvtier_router:prefills_total{outcome="ok"}')
    loaded = metric(decode.url, "kvtier:p2p_connector_blocks_loaded")
    body = {"input": "disaggregated responses " * 3, "max_output_tokens": 4, "temperature": 0}
    first = httpx.post(f"{router.url}/v1/responses", timeout=TIMEOUT_S, json=body)
    assert first.status_code == 200, first.text
    # The same request answered by one instance alone (the producer: no transfer asked).
    alone = httpx.post(f"{prefill.url}/v1/responses", timeout=TIMEOUT_S,
                       json={**body, "store": False})
    text = [item["content"] for item in first.json()["output"]]
    assert text == [item["content"] for item in alone.json()["output"]]
    assert metric(router.url, 'kvtier_router:prefills_total{outcome="ok"}') == prefills + 1
    assert metric(decode.url, "kvtier:p2p_connector_blocks_loaded") > loaded
    # Stored on the decode instance: the next turn goes there, with no prefill (the prefill
    # instance does not have the conversation).
    second = httpx.post(f"{router.url}/v1/responses", timeout=TIMEOUT_S, json={
        "input": "and then?", "previous_response_id": first.json()["id"],
        "max_output_tokens": 4, "temperature": 0})
    assert second.status_code == 200, second.text
    assert second.headers["x-kvtier-instance"] == decode.url
    assert metric(router.url, 'kvtier_router:prefills_total{outcome="ok"}') == prefills + 1


def test_pd_messages_load_their_prompt_on_the_decode_instance(pd):
    router, prefill, decode, _ = pd
    prefills = metric(router.url, 'kvtier_router:prefills_total{outcome="ok"}')
    loaded = metric(decode.url, "kvtier:p2p_connector_blocks_loaded")
    body = {"max_tokens": 4, "temperature": 0, "system": "Anthropic's shape",
            "messages": [{"role": "user", "content": "disaggregated messages " * 3}]}
    routed = httpx.post(f"{router.url}/v1/messages", timeout=TIMEOUT_S, json=body)
    assert routed.status_code == 200, routed.text
    # The same request answered by one instance alone (the producer: no transfer asked).
    alone = httpx.post(f"{prefill.url}/v1/messages", timeout=TIMEOUT_S, json=body)
    assert routed.json()["content"] == alone.json()["content"]
    assert routed.headers["x-kvtier-instance"] == decode.url
    assert metric(router.url, 'kvtier_router:prefills_total{outcome="ok"}') == prefills + 1
    assert metric(decode.url, "kvtier:p2p_connector_blocks_loaded") > loaded


@pytest.mark.faults
def test_pd_prefill_instance_killed_the_decode_instance_computes(pd):
    """Last in the module: it kills the prefill instance."""
    router, prefill, decode, hf_model = pd
    prompts = make_block_prompts(seed=2)
    expected = hf_greedy(hf_model, prompts, MAX_TOKENS)
    assert complete(router.url, prompts[0])["choices"][0]["token_ids"] == expected[0]
    prefill.process.send_signal(signal.SIGKILL)
    prefill.process.wait(30)
    loaded = metric(decode.url, "kvtier:p2p_connector_blocks_loaded")
    results = [complete(router.url, prompt) for prompt in prompts[1:]]
    assert token_ids(results) == expected[1:]
    # Nothing came from the dead instance: the decode instance computed those prompts.
    assert metric(decode.url, "kvtier:p2p_connector_blocks_loaded") == loaded
    failed = metric(router.url, 'kvtier_router:prefills_total{outcome="unreachable"}') + \
        metric(router.url, 'kvtier_router:prefills_total{outcome="no_instance"}')
    assert failed == len(prompts) - 1
    assert metric(router.url, "kvtier_router:retries_total") == 0
