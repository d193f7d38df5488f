"""The real server process, driven with the official openai client and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import msgpack
import openai
import pytest
import torch
import zmq
from prometheus_client.parser import text_string_to_metric_families

from kvtier.models.tokenizer import Tokenizer

from ..tiny_models import hf_greedy
from .server_process import ServerProcess, free_port
from .test_privacy import PROMPT, usages

API_KEY = "test-key"
MODEL = "tiny"
TOPIC = "kv-events"
# Greedy, fixed length: outputs are comparable token for token with HF transformers.
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True, "return_token_ids": True}}
IDLE_DEADLINE_S = 30.0


@pytest.fixture(scope="module")
def server(tiny_model):
    model_dir, _ = tiny_model
    events_port = free_port()
    events = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://127.0.0.1:{events_port}", "topic": TOPIC}
    proc = ServerProcess(model_dir, "--api-key", API_KEY, "--served-model-name", MODEL,
                         "--num-device-blocks", "128", "--block-size", "16",
                         "--max-model-len", "256",
                         "--kv-events-config", json.dumps(events))
    proc.events_endpoint = events["endpoint"]
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                       timeout=60.0) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return Tokenizer.from_hf_dir(tiny_model[0])


def metrics(server) -> dict[str, float]:
    """Every sample of /metrics, parsed with prometheus_client's parser, as name{labels}; the
    labels every series has (vLLM's model_name and engine) are checked and left out."""
    text = httpx.get(f"{server.url}/metrics", timeout=10.0).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            own = dict(sample.labels)
            assert (own.pop("model_name"), own.pop("engine")) == (MODEL, "0"), sample
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(own.items()))
            values[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return values


def wait_idle(server) -> dict[str, float]:
    deadline = time.monotonic() + IDLE_DEADLINE_S
    while time.monotonic() < deadline:
        values = metrics(server)
        if values["vllm:num_requests_running"] == 0 and values["vllm:num_requests_waiting"] == 0 \
                and values["vllm:kv_cache_usage_perc"] == 0:
            return values
        time.sleep(0.1)
    raise AssertionError(f"server not idle within {IDLE_DEADLINE_S} s: {values}")


def test_completion_matches_hf_greedy(client, tiny_model, tokenizer):
    prompt_ids = tokenizer.encode("The kv cache")
    expected = hf_greedy(tiny_model[1], [prompt_ids], 8)[0]
    result = client.completions.create(model=MODEL, prompt="The kv cache", max_tokens=8,
                                       **GREEDY)
    choice = result.choices[0]
    assert result.id.startswith("cmpl-")
    assert choice.token_ids == expected
    assert choice.text == tokenizer.decode(expected)
    assert choice.finish_reason == "length"
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (len(prompt_ids), 8)


def test_penalties_and_logit_bias_reach_the_sampler(client, tiny_model):
    # HF's repetition_penalty and sequence_bias processors are the reference (the -1000 asked
    # is clamped to -100, as OpenAI documents: either bans the token).
    prompt = [5, 6, 7, 8, 9, 10]
    plain = hf_greedy(tiny_model[1], [prompt], 10)[0]
    bias = {plain[0]: -100.0, plain[2]: 2.0}
    with torch.no_grad():
        generated = tiny_model[1].generate(
            torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10, do_sample=False,
            pad_token_id=0, repetition_penalty=1.5,
            sequence_bias={(token,): value for token, value in bias.items()})
    expected = generated[0, len(prompt):].tolist()
    assert expected != plain
    result = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=10, temperature=0.0,
        logit_bias={str(plain[0]): -1000, str(plain[2]): 2.0},
        extra_body={"ignore_eos": True, "return_token_ids": True, "repetition_penalty": 1.5})
    assert result.choices[0].token_ids == expected


def test_completion_stream_equals_non_stream(client, tiny_model):
    prompt = [5, 6, 7, 8, 9, 10]
    expected = hf_greedy(tiny_model[1], [prompt], 10)[0]
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, stream=True,
                                       stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    token_ids = [t for c in chunks for ch in c.choices for t in (ch.token_ids or [])]
    assert token_ids == expected
    assert [ch.finish_reason for c in chunks for ch in c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_chat_stream_and_non_stream_agree(client, tokenizer):
    messages = [{"role": "user", "content": "Where is the cache?"}]
    template = tokenizer.apply_chat_template(messages)
    num_prompt = len(tokenizer.encode(template, add_special_tokens=False))
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                          **GREEDY)
    assert full.id.startswith("chatcmpl-")
    assert full.choices[0].message.role == "assistant"
    assert full.usage.prompt_tokens == num_prompt and full.usage.completion_tokens == 6
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                            stream=True, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_and_request_id_header(server):
    body = {"model": MODEL, "prompt": [3, 4, 5], "max_tokens": 4, "n": 3, "seed": 7,
            "ignore_eos": True}
    headers = {"Authorization": f"Bearer {API_KEY}", "X-Request-Id": "abc123"}
    response = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers,
                          timeout=60.0)
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "abc123"  # echoed as sent
    data = response.json()
    assert data["id"] == "cmpl-abc123"
    assert sorted(c["index"] for c in data["choices"]) == [0, 1, 2]
    assert data["usage"]["completion_tokens"] == 12


def test_cached_tokens_are_not_reported_by_default(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for usage in usages(server, MODEL, headers):
        assert usage["prompt_tokens"] == len(PROMPT)
        assert "prompt_tokens_details" not in usage


def test_models_health_version(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json() == {"version": "0.1.0"}


@pytest.mark.parametrize("body, param, code", [
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "max_tokens": -3}, "max_tokens", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "temperature": -1}, "temperature", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "top_p": 1.5}, "top_p", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "top_k": -2}, "top_k", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "n": 0}, "n", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "logprobs": 50}, "logprobs", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "max_tokens": "many"}, "max_tokens", "invalid_value"),
    ({"model": MODEL, "prompt": "x" * 300}, "prompt", "context_length_exceeded"),
    ({"model": MODEL, "prompt": "x" * 200, "max_tokens": 100}, "max_tokens",
     "context_length_exceeded"),
    ({"model": MODEL, "prompt": [1, 99999]}, "prompt", "invalid_value"),
    ({"model": MODEL, "prompt": ""}, "prompt", "invalid_value"),
    ({"model": MODEL}, "prompt", "missing_required_parameter"),
    ({"model": MODEL, "prompt": "x", "presence_penalty": 2.5}, "presence_penalty",
     "invalid_value"),
    ({"model": MODEL, "prompt": "x", "frequency_penalty": -3}, "frequency_penalty",
     "invalid_value"),
    ({"model": MODEL, "prompt": "x", "repetition_penalty": 0}, "repetition_penalty",
     "invalid_value"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias",
     "invalid_value"),
])
def test_bad_completion_requests_are_400_naming_the_field(server, body, param, code):
    response = httpx.post(f"{server.url}/v1/completions", json=body,
                          headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30.0)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param,
                                                              code)
    assert error["message"]


def test_bad_chat_requests_and_malformed_json(server):
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    bad_json = httpx.post(f"{server.url}/v1/chat/completions", content=b'{"messages": [',
                          headers=headers)
    assert bad_json.status_code == 400
    assert bad_json.json()["error"]["code"] == "invalid_json"
    too_long = httpx.post(f"{server.url}/v1/chat/completions", headers=headers, json={
        "model": MODEL, "messages": [{"role": "user", "content": "y" * 400}]})
    assert too_long.status_code == 400
    assert too_long.json()["error"]["param"] == "messages"
    zero = httpx.post(f"{server.url}/v1/chat/completions", headers=headers, json={
        "model": MODEL, "messages": [{"role": "user", "content": "y"}],
        "max_completion_tokens": 0})
    assert zero.json()["error"]["param"] == "max_completion_tokens"


def test_api_key_required(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = httpx.post(f"{server.url}/v1/completions", headers=headers,
                              json={"model": MODEL, "prompt": "x"})
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()


def test_client_disconnect_aborts_request(server):
    before = metrics(server)
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 200, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60.0,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    after = wait_idle(server)
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert 1 <= generated < 200


def test_32_concurrent_clients_no_leaked_blocks(server, tiny_model):
    expected = hf_greedy(tiny_model[1], [[11, 12, 13]], 5)[0]

    async def run_all() -> list:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY,
                                      max_retries=0, timeout=120.0) as aclient:
            return await asyncio.gather(*(
                aclient.completions.create(model=MODEL, prompt=[11, 12, 13] + [20 + i] * i,
                                           max_tokens=5, **GREEDY)
                for i in range(32)))

    before = metrics(server)
    results = asyncio.run(run_all())
    assert len(results) == 32
    assert all(len(r.choices[0].token_ids) == 5 for r in results)
    assert results[0].choices[0].token_ids == expected
    after = wait_idle(server)
    done = 'vllm:request_success_total{finished_reason="length"}'
    assert after[done] - before.get(done, 0) == 32


def test_metrics_move_as_requests_run(server, client):
    before = metrics(server)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:time_to_first_token_seconds_count",
                 "vllm:e2e_request_latency_seconds_count"):
        assert name in before, name
    prompt = list(range(40, 80))  # 40 tokens: two full blocks to hit the second time
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, **GREEDY)
    after = metrics(server)
    delta = {k: after[k] - before.get(k, 0) for k in after if not k.endswith("_created")}
    assert delta["vllm:prompt_tokens_total"] == 80
    assert delta["vllm:generation_tokens_total"] == 6
    assert delta["vllm:prefix_cache_hits_total"] == 32
    assert delta["vllm:e2e_request_latency_seconds_count"] == 2
    assert delta["vllm:time_to_first_token_seconds_count"] == 2
    assert delta['vllm:request_params_max_tokens_count'] == 2
    assert delta['http_requests_total{handler="/v1/completions",method="POST",status="2xx"}'] == 2


def test_zmq_subscriber_receives_block_stored(server, client, tokenizer):
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
    sub.connect(server.events_endpoint)
    try:
        time.sleep(0.5)  # PUB drops messages until the subscription has propagated
        prompt = list(range(100, 133))  # 33 tokens: two full blocks of 16
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, **GREEDY)
        stored = _collect_block_stored(sub)
    finally:
        sub.close(linger=0)
    # One event for the two full blocks, a map in vLLM's field names.
    hashes = stored[0].pop("block_hashes")
    assert stored[0] == {"type": "BlockStored", "parent_block_hash": None,
                         "token_ids": prompt[:32], "block_size": 16, "lora_id": None,
                         "medium": "GPU", "lora_name": None, "group_idx": 0,
                         "kv_cache_spec_kind": "full_attention", "locality": "LOCAL"}
    assert len(hashes) == 2 and all(isinstance(h, int) and 0 <= h < 2 ** 64 for h in hashes)


def _collect_block_stored(sub) -> list:
    """BlockStored events for this test's prompt (the first token id is 100)."""
    deadline = time.monotonic() + 10.0
    stored = []
    while time.monotonic() < deadline and not stored:
        if not sub.poll(500):
            continue
        topic, seq, payload = sub.recv_multipart()
        assert topic == TOPIC.encode() and len(seq) == 8
        ts, events, rank = msgpack.unpackb(payload)
        assert isinstance(ts, float) and rank == 0
        stored += [e for e in events
                   if e["type"] == "BlockStored" and e["token_ids"][:1] == [100]]
    return stored

