"""The router's P/D mode with real processes: a prefill and a decode `kvtier serve` (the
P2PConnector as producer and consumer, over loopback) and a `kvtier router --prefill --decode`
in front. Tokens equal HF's greedy ones (what one colocated instance gives), the decode instance
loads the prompts' KV instead of computing it, and a dead prefill instance costs no client an
error or a different token."""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from ..entrypoints.server_process import ServerProcess
from ..tiny_models import hf_greedy, make_block_prompts, make_hf_model, random_prompts
from .conftest import RouterProcess

BLOCK_SIZE = 4
MAX_TOKENS = 6
TIMEOUT_S = 120.0
NUM_CONCURRENT = 16
# Sends end within a step or two of the decode instance's load; bounds it on a busy machine.
IDLE_DEADLINE_S = 15.0
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
          "return_token_ids": True}


def _transfer_config(role: str, **extra) -> str:
    return json.dumps({"kv_connector": "P2PConnector", "kv_role": role,
                       "kv_load_timeout_s": 10.0, "kv_connector_extra_config": extra})


def _serve_args(role: str, **extra) -> list[str]:
    return ["--block-size", str(BLOCK_SIZE), "--num-device-blocks", "64",
            "--enable-prompt-tokens-details", "--kv-transfer-config",
            _transfer_config(role, **extra)]


def _pd_ready(state: dict) -> bool:
    return all(i["healthy"] for i in state["instances"]) and \
        any(i["transport_address"] for i in state["instances"])


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    """(router, prefill, decode, hf model): started once for the module."""
    directory = str(tmp_path_factory.mktemp("pd_llama"))
    hf_model = make_hf_model("llama", directory, tokenizer="bytes")
    with ThreadPoolExecutor(2) as pool:
        starts = [pool.submit(ServerProcess, directory,
                              *_serve_args("kv_producer", send_timeout_s=10.0)),
                  pool.submit(ServerProcess, directory, *_serve_args("kv_consumer"))]
        prefill, decode = [start.result() for start in starts]
    router = None
    try:
        router = RouterProcess(directory, [], "--prefill", prefill.url, "--decode", decode.url,
                               "--prefill-timeout", "30", ready=_pd_ready)
        yield router, prefill, decode, hf_model
    finally:
        if router is not None:
            router.stop()
        for server in (prefill, decode):
            server.stop()


def _metric(url: str, series: str) -> float:
    """The sum of a series' samples (a counter's name with or without _total; labels given
    select one sample)."""
    name, brace, labels = series.partition("{")
    names = (name, f"{name}_total")
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=5.0).text.splitlines():
        key, _, value = line.rpartition(" ")
        wanted = key in {n + brace + labels for n in names} if labels \
            else key.partition("{")[0] in names
        if wanted and not line.startswith("#"):
            total += float(value)
    return total


def _complete(router, prompt: list[int]) -> dict:
    response = httpx.post(f"{router.url}/v1/completions", timeout=TIMEOUT_S,
                          json={"prompt": prompt, **GREEDY})
    assert response.status_code == 200, response.text
    return response.json()


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


def _loaded_tokens(prompt: list[int]) -> int:
    """Prompt tokens the decode instance takes from the prefill: every full block before the
    last token (the one it computes to sample)."""
    return (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE


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
    results = [_complete(router, prompt) for prompt in prompts]
    assert [r["choices"][0]["token_ids"] for r in results] == expected
    # Every full block before the last token was the decode instance's without computing it:
    # loaded from the prefill instance, or (the third prompt shares the first's 3 blocks) from
    # its own prefix cache.
    assert [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in results] == \
        [_loaded_tokens(p) for p in prompts]
    # (19, 16, 13, 23, 6 tokens) -> 4, 3, -, 5, 1 blocks over the transport.
    assert _metric(decode.url, "kvtier:p2p_connector_blocks_loaded") == 13
    assert _metric(decode.url, "vllm:prefix_cache_hits") == 3 * BLOCK_SIZE
    assert _metric(router.url, 'kvtier_router:prefills_total{outcome="ok"}') == len(prompts)
    # The third prompt's transfer too: the decode instance takes it (and drops it) to free the
    # prefill instance's blocks.
    assert _metric(prefill.url, "kvtier:p2p_connector_requests_sent") == len(prompts)


@pytest.mark.slow
def test_pd_streaming_and_chat_match_hf(pd):
    router, _, decode, hf_model = pd
    prompts = make_block_prompts(seed=1)
    expected = hf_greedy(hf_model, prompts, MAX_TOKENS)
    for prompt, tokens in zip(prompts, expected):
        streamed, usage = _complete_streamed(router, prompt)
        assert streamed == tokens
        assert usage["prompt_tokens_details"]["cached_tokens"] == _loaded_tokens(prompt)
    response = httpx.post(f"{router.url}/v1/chat/completions", timeout=TIMEOUT_S, json={
        "messages": [{"role": "user", "content": "disaggregated " * 3}], **GREEDY})
    assert response.status_code == 200, response.text
    body = response.json()
    prompt_ids = body["prompt_token_ids"]
    assert body["choices"][0]["token_ids"] == hf_greedy(hf_model, [prompt_ids], MAX_TOKENS)[0]
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == _loaded_tokens(prompt_ids)


@pytest.mark.slow
def test_pd_concurrent_requests_match_hf_and_leave_no_blocks_held(pd):
    router, prefill, decode, hf_model = pd
    prompts = random_prompts(NUM_CONCURRENT, 21, seed=3)
    expected = hf_greedy(hf_model, prompts, MAX_TOKENS)
    with ThreadPoolExecutor(NUM_CONCURRENT) as pool:
        results = list(pool.map(lambda p: _complete(router, p), prompts))
    assert [r["choices"][0]["token_ids"] for r in results] == expected
    assert all(r["usage"]["prompt_tokens_details"]["cached_tokens"] == 20 for r in results)
    # Every send ended and every request finished: no block is held on either side.
    for server in (prefill, decode):
        deadline = time.monotonic() + IDLE_DEADLINE_S
        while _metric(server.url, "vllm:kv_cache_usage_perc") != 0:
            assert time.monotonic() < deadline, f"{server.url} still holds KV blocks"
            time.sleep(0.1)
    assert _metric(prefill.url, "kvtier:p2p_connector_send_errors") == 0


@pytest.mark.faults
def test_pd_prefill_instance_killed_the_decode_instance_computes(pd):
    """Last in the module: it kills the prefill instance."""
    router, prefill, decode, hf_model = pd
    prompts = make_block_prompts(seed=2)
    expected = hf_greedy(hf_model, prompts, MAX_TOKENS)
    assert _complete(router, prompts[0])["choices"][0]["token_ids"] == expected[0]
    prefill.process.send_signal(signal.SIGKILL)
    prefill.process.wait(30)
    loaded = _metric(decode.url, "kvtier:p2p_connector_blocks_loaded")
    results = [_complete(router, prompt) for prompt in prompts[1:]]
    assert [r["choices"][0]["token_ids"] for r in results] == expected[1:]
    # Nothing came from the dead instance: the decode instance computed those prompts.
    assert _metric(decode.url, "kvtier:p2p_connector_blocks_loaded") == loaded
    failed = _metric(router.url, 'kvtier_router:prefills_total{outcome="unreachable"}') + \
        _metric(router.url, 'kvtier_router:prefills_total{outcome="no_instance"}')
    assert failed == len(prompts) - 1
    assert _metric(router.url, "kvtier_router:retries_total") == 0
