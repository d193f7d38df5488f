"""P/D faults with real processes: a prefill `kvtier serve` (P2PConnector producer) in front of
two decode instances (consumers), each behind its own `kvtier router --prefill --decode`. One
decode instance runs the same weights; the other runs other weights, so its KV namespace
differs. A refused peer costs the client nothing but time (the decode instance computes the
prompt; tokens equal HF's greedy ones), and a decode instance killed while the prefill
instance holds KV for it costs the prefill instance no block past its send deadline."""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from ..entrypoints.server_process import ServerProcess
from ..router.pd_cluster import (
    MAX_TOKENS,
    TIMEOUT_S,
    complete,
    metric,
    serve_args,
    start_pd_router,
    token_ids,
    wait_until_idle,
)
from ..tiny_models import hf_greedy, make_hf_model, random_prompts

SEND_TIMEOUT_S = 5.0
# The decode instance that refuses waits this long for a transfer that never comes.
REFUSED_LOAD_TIMEOUT_S = 2.0
NUM_HELD = 4


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    """(prefill, decode, other decode, router to decode, router to other, hf model, other hf
    model)."""
    directory = str(tmp_path_factory.mktemp("pd_faults"))
    other_directory = str(tmp_path_factory.mktemp("pd_faults_other"))
    hf_model = make_hf_model("llama", directory, tokenizer="bytes")
    other_hf_model = make_hf_model("llama", other_directory, seed=1, tokenizer="bytes")
    with ThreadPoolExecutor(3) as pool:
        starts = [pool.submit(ServerProcess, directory,
                              *serve_args("kv_producer", send_timeout_s=SEND_TIMEOUT_S)),
                  pool.submit(ServerProcess, directory, *serve_args("kv_consumer")),
                  pool.submit(ServerProcess, other_directory,
                              *serve_args("kv_consumer", REFUSED_LOAD_TIMEOUT_S))]
        servers = [start.result() for start in starts]
    prefill, decode, other = servers
    routers = []
    try:
        routers = [start_pd_router(directory, prefill.url, server.url)
                   for server in (decode, other)]
        yield prefill, decode, other, *routers, hf_model, other_hf_model
    finally:
        for process in (*routers, *servers):
            process.stop()


def test_pd_decode_instance_of_another_namespace_is_refused_and_computes(pd):
    prefill, _, other, _, other_router, _, other_hf_model = pd
    prompts = random_prompts(3, 17, seed=5)
    results = [complete(other_router.url, prompt) for prompt in prompts]
    # Its own weights' tokens, and nothing taken from the prefill instance's KV.
    assert token_ids(results) == hf_greedy(other_hf_model, prompts, MAX_TOKENS)
    assert all(r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 for r in results)
    assert metric(other.url, "kvtier:p2p_connector_blocks_loaded") == 0
    assert metric(other.url, "kvtier:kv_load_failures") == len(prompts)
    # The prefill instance did its part; the handshake refused every send, counted as such.
    assert metric(other_router.url, 'kvtier_router:prefills_total{outcome="ok"}') == \
        len(prompts)
    assert metric(prefill.url, "kvtier:p2p_connector_sends_refused") == len(prompts)
    assert metric(prefill.url, "kvtier:p2p_connector_send_errors") == len(prompts)
    for server in (prefill, other):
        wait_until_idle(server.url)


def _prefill_for(url: str, prompt: list[int], consumer_address: str, transfer_id: str) -> None:
    """What the router asks of the prefill instance: compute `prompt` and hold its KV for
    `consumer_address`."""
    response = httpx.post(f"{url}/v1/completions", timeout=TIMEOUT_S, json={
        "prompt": prompt, "max_tokens": 1, "temperature": 0, "kv_transfer_params": {
            "transfer_id": transfer_id, "consumer_address": consumer_address}})
    assert response.status_code == 200, response.text
    assert response.json()["kv_transfer_params"]["num_tokens"] == 16


def test_pd_decode_instance_killed_the_prefill_instance_frees_its_blocks(pd):
    """Last in the module: it kills the decode instance. The prefill instance holds KV for
    requests the router has yet to hand the decode instance; the decode instance dies before
    it takes them."""
    prefill, decode, _, router, _, hf_model, _ = pd
    prompts = random_prompts(NUM_HELD + 1, 17, seed=6)
    warm = complete(router.url, prompts[0])  # the prefill instance is connected to it
    assert token_ids([warm]) == hf_greedy(hf_model, prompts[:1], MAX_TOKENS)
    wait_until_idle(prefill.url)
    address = httpx.get(f"{decode.url}/v1/kv_transfer_info", timeout=5.0).json()[
        "transport_address"]
    errors = metric(prefill.url, "kvtier:p2p_connector_send_errors")
    for i, prompt in enumerate(prompts[1:]):
        _prefill_for(prefill.url, prompt, address, f"held-{i}")
    assert metric(prefill.url, "vllm:kv_cache_usage_perc") > 0
    decode.process.send_signal(signal.SIGKILL)
    decode.process.wait(30)
    # The sends fail by their deadline (with slack for a busy machine) and free the blocks.
    wait_until_idle(prefill.url, SEND_TIMEOUT_S + 10.0)
    assert metric(prefill.url, "kvtier:p2p_connector_send_errors") - errors == NUM_HELD
    # A send to the dead address fails at the dial and frees its blocks too; the prefill
    # instance still answers as before.
    _prefill_for(prefill.url, prompts[1], address, "after-kill")
    wait_until_idle(prefill.url, 5.0 + 10.0)
    assert metric(prefill.url, "kvtier:p2p_connector_send_errors") - errors == NUM_HELD + 1
    assert token_ids([complete(prefill.url, prompts[1])]) == \
        hf_greedy(hf_model, prompts[1:2], MAX_TOKENS)
