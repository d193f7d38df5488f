"""The P/D flow's requests and fallbacks, in-process, against two small HTTP apps standing in
for the instances: a real `kvtier serve` cannot be made to answer a prefill with a 500, too
slowly, or without kv_transfer_params (the real 1P1D is tests/router/test_pd_e2e.py)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kvtier.router.config import RouterConfig
from kvtier.router.disagg import fans_out, prefill_body
from kvtier.router.prompts import PromptHasher
from kvtier.router.service import RouterService

from ..entrypoints.server_process import free_port
from .asgi_client import run_scenario

PREFILL_TIMEOUT_S = 0.5


class _Instance:
    """A uvicorn app on a free port, in a thread; `seen` keeps the completion bodies received."""

    def __init__(self, answer, info: dict) -> None:
        self.seen: list[dict] = []
        app = FastAPI()
        app.get("/health")(lambda: {})
        app.get("/v1/kv_transfer_info")(lambda: info)

        @app.post("/v1/completions")
        async def completions(raw: Request):
            body = await raw.json()
            self.seen.append(body)
            return await answer(body)

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


async def _prefill_answer(body: dict):
    mode = body["prompt"]
    if mode == "error":
        return JSONResponse({"error": {"message": "boom"}}, status_code=500)
    if mode == "slow":
        await asyncio.sleep(PREFILL_TIMEOUT_S * 4)
    params = None if mode == "no_params" else \
        {"transfer_id": body["kv_transfer_params"]["transfer_id"], "num_tokens": 8}
    return {"choices": [{"text": "x"}], "kv_transfer_params": params}


async def _decode_answer(body: dict):
    return {"choices": [{"text": "decoded"}]}


@pytest.fixture(scope="module")
def instances():
    prefill = _Instance(_prefill_answer, {"kv_connector": "P2PConnector",
                                          "kv_role": "kv_producer", "transport_address": None})
    decode = _Instance(_decode_answer, {"kv_connector": "P2PConnector", "kv_role": "kv_consumer",
                                        "transport_address": "tcp://0.0.0.0:5555"})
    yield prefill, decode
    prefill.stop()
    decode.stop()


def _run(instances, scenario, **config) -> None:
    prefill, decode = instances
    service = RouterService(RouterConfig(prefill=(prefill.url,), decode=(decode.url,),
                                         prefill_timeout_s=PREFILL_TIMEOUT_S, **config))

    async def main() -> None:
        deadline = time.monotonic() + 10.0
        while not all(i.healthy for i in service.instances):
            assert time.monotonic() < deadline, "the stand-in instances did not come up"
            for instance in service.instances:
                await service.check(instance)
            await asyncio.sleep(0.05)
        await run_scenario(service, scenario)

    asyncio.run(main())


def test_the_prefill_gets_the_prompt_and_the_decode_its_kv_transfer_params(instances):
    prefill, decode = instances

    async def scenario(service, client):
        # A wildcard bind address is reached on the decode instance's own host.
        assert service.instances[1].transport_address == "tcp://127.0.0.1:5555"
        response = await client.post("/v1/completions", json={
            "prompt": "ok", "max_tokens": 9, "stream_options": {"include_usage": True},
            "min_tokens": 3, "kv_transfer_params": {"transfer_id": "client's"}})
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == "decoded"
        sent = prefill.seen[-1]
        transfer_id = sent["kv_transfer_params"]["transfer_id"]
        assert sent == {"prompt": "ok", "max_tokens": 1, "n": 1, "stream": False,
                        "kv_transfer_params": {"transfer_id": transfer_id,
                                               "consumer_address": "tcp://127.0.0.1:5555"}}
        assert decode.seen[-1] == {"prompt": "ok", "max_tokens": 9, "min_tokens": 3,
                                   "stream_options": {"include_usage": True},
                                   "kv_transfer_params": {"transfer_id": transfer_id,
                                                          "num_tokens": 8}}
        assert 'kvtier_router:prefills_total{outcome="ok"} 1.0' in service.metrics.render() \
            .decode()
        assert (service.instances[0].in_flight, service.instances[1].in_flight) == (0, 0)

    _run(instances, scenario)


@pytest.mark.parametrize("body, outcome", [
    ({"prompt": "error"}, "status_5xx"), ({"prompt": "slow"}, "timeout"),
    ({"prompt": "no_params"}, "no_kv_transfer_params"),
    # Several engine requests on the decode instance: not split, whatever the prefill would do.
    ({"prompt": "ok", "n": 2}, "fan_out"), ({"prompt": ["ok", "ok"]}, "fan_out")])
def test_a_failed_prefill_leaves_the_prompt_to_the_decode_instance(instances, body, outcome):
    prefill, decode = instances
    num_prefills = len(prefill.seen)

    async def scenario(service, client):
        response = await client.post("/v1/completions", json={**body, "max_tokens": 4})
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == "decoded"
        assert decode.seen[-1] == {**body, "max_tokens": 4}
        metrics = service.metrics.render().decode()
        assert f'kvtier_router:prefills_total{{outcome="{outcome}"}} 1.0' in metrics
        # Busy or answering badly is not down: the prefill instance stays in routing.
        assert service.instances[0].healthy and service.instances[0].in_flight == 0
        assert len(prefill.seen) == num_prefills + (outcome != "fan_out")

    _run(instances, scenario)


def test_a_prompt_the_decode_instance_lacks_little_of_is_computed_there(instances):
    prefill, decode = instances

    async def scenario(service, client):
        # The stand-ins publish no events: hash token-id prompts as 4-token-block engines do,
        # and tell the index what the decode instance holds.
        service.hasher = PromptHasher(None, 4, "sha256_cbor")
        decode_instance = service.instances[1]
        decode_instance.indexed = True
        num_prefills = len(prefill.seen)
        for prompt in ([1, 2, 3, 4, 5, 6], list(range(1, 9))):  # 6 and 8 tokens uncached
            body = {"prompt": prompt, "max_tokens": 4}
            assert (await client.post("/v1/completions", json=body)).status_code == 200
            assert decode.seen[-1] == body
        assert len(prefill.seen) == num_prefills
        # 9 tokens, none cached: a prefill. Then 2 of its blocks cached on the decode
        # instance leave 1 uncached: computed there.
        body = {"prompt": list(range(1, 10)), "max_tokens": 4}
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        assert prefill.seen[-1]["prompt"] == body["prompt"]
        assert decode.seen[-1]["kv_transfer_params"]["num_tokens"] == 8
        hashes = service.hasher.block_hashes_of(body["prompt"])
        service.index.store(decode_instance.slot, hashes, "GPU")
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        assert decode.seen[-1] == body and len(prefill.seen) == num_prefills + 1
        metrics = service.metrics.render().decode()
        assert 'kvtier_router:prefills_total{outcome="local"} 3.0' in metrics
        assert 'kvtier_router:prefills_total{outcome="ok"} 1.0' in metrics

    _run(instances, scenario, local_prefill_tokens=8)


def test_a_chat_prefill_asks_for_one_completion_token():
    body = {"messages": [], "max_tokens": 5, "max_completion_tokens": 7, "stream": True}
    assert prefill_body("/v1/chat/completions", body, "t", "tcp://a:1") == {
        "messages": [], "max_completion_tokens": 1, "n": 1, "stream": False,
        "kv_transfer_params": {"transfer_id": "t", "consumer_address": "tcp://a:1"}}


def test_a_responses_prefill_asks_for_one_output_token_and_is_not_stored():
    body = {"input": "hi", "max_output_tokens": 9, "stream": True, "instructions": "x"}
    assert prefill_body("/v1/responses", body, "t", "tcp://a:1") == {
        "input": "hi", "instructions": "x", "max_output_tokens": 1, "store": False,
        "stream": False,
        "kv_transfer_params": {"transfer_id": "t", "consumer_address": "tcp://a:1"}}


def test_a_messages_prefill_asks_for_one_output_token():
    body = {"messages": [], "max_tokens": 9, "stream": True, "system": "x"}
    assert prefill_body("/v1/messages", body, "t", "tcp://a:1") == {
        "messages": [], "system": "x", "max_tokens": 1, "stream": False,
        "kv_transfer_params": {"transfer_id": "t", "consumer_address": "tcp://a:1"}}


def test_pd_config_errors_name_the_flags():
    with pytest.raises(ValueError, match="not both"):
        RouterConfig(instances=("http://a:1",), decode=("http://b:1",))
    with pytest.raises(ValueError, match="one --decode URL"):
        RouterConfig(prefill=("http://a:1",))
    with pytest.raises(ValueError, match="--decode 'b:1' is not an http"):
        RouterConfig(prefill=("http://a:1",), decode=("b:1",))
    with pytest.raises(ValueError, match="distinct"):
        RouterConfig(prefill=("http://a:1",), decode=("http://a:1",))
    with pytest.raises(ValueError, match="--local-prefill-tokens is for P/D mode"):
        RouterConfig(instances=("http://a:1",), local_prefill_tokens=64)
    with pytest.raises(ValueError, match="needs --policy kv-aware"):
        RouterConfig(prefill=("http://a:1",), decode=("http://b:1",), policy="round-robin",
                     local_prefill_tokens=64)
    with pytest.raises(ValueError, match=">= 0"):
        RouterConfig(prefill=("http://a:1",), decode=("http://b:1",), local_prefill_tokens=-1)


@pytest.mark.parametrize("body, several", [
    ({"prompt": "ok"}, False), ({"prompt": "ok", "n": None, "best_of": None}, False),
    ({"prompt": "ok", "n": 1}, False), ({"prompt": "ok", "n": 2}, True),
    ({"prompt": "ok", "best_of": 3}, True), ({"prompt": [1, 2, 3]}, False),
    ({"prompt": ["a", "b"]}, True)])
def test_only_bodies_the_instance_splits_fan_out(body, several):
    # A null is a field left out: the instance reads n null as 1.
    assert fans_out(body) is several
