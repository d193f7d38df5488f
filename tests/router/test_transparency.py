"""The router answers as its instance would: the instance's own errors (a full queue's 503), its
model endpoints and probes, an API key on the instance; a client that leaves cancels its request
there; a slow answer is a 504 that leaves the instance in routing; an instance lost mid-stream
ends the stream with an error event. Real `kvtier serve` processes."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from kvtier.router.config import RouterConfig
from kvtier.router.service import RouterService

from ..entrypoints.server_process import ServerProcess
from ..tiny_models import make_hf_model
from .asgi_client import run_scenario
from .conftest import RouterProcess, all_indexed, events_config

KEY = "instance-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
NAME = "tiny"
# Long enough to be in flight for seconds on any machine: the tests cut it short.
LONG = {"model": NAME, "prompt": [5, 6, 7], "max_tokens": 3000, "ignore_eos": True,
        "temperature": 0.0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("long_llama"))
    make_hf_model("llama", directory, tokenizer="bytes", max_position_embeddings=4096)
    return directory


def _instance(model_dir: str, *extra: str) -> ServerProcess:
    return ServerProcess(model_dir, "--served-model-name", NAME, "--block-size", "16",
                         "--num-device-blocks", "300", "--max-model-len", "4096",
                         "--kv-events-config", events_config(), *extra)


@pytest.fixture(scope="module")
def cluster(model_dir):
    """One instance that wants an API key and queues at most one request, and a router."""
    instance = _instance(model_dir, "--api-key", KEY, "--max-num-seqs", "1",
                         "--max-waiting-requests", "1")
    router = None
    try:
        router = RouterProcess(model_dir, [instance.url], "--instance-api-key", KEY,
                               ready=all_indexed)  # its KV events read with the key
        yield router, instance
    finally:
        if router is not None:
            router.stop()
        instance.stop()


def _instance_metric(instance: ServerProcess, name: str) -> float:
    for line in httpx.get(f"{instance.url}/metrics", timeout=10.0).text.splitlines():
        if line.partition(" ")[0].partition("{")[0] == name:  # labels: model_name, engine
            return float(line.split()[-1])
    return 0.0


def _wait_idle(instance: ServerProcess) -> None:
    deadline = time.monotonic() + 20.0
    while _instance_metric(instance, "vllm:num_requests_running") or \
            _instance_metric(instance, "vllm:num_requests_waiting"):
        assert time.monotonic() < deadline, "the instance still runs a request"
        time.sleep(0.1)


def _timeless(body):
    """A model card or list without its `created` times."""
    if isinstance(body, dict):
        return {k: _timeless(v) for k, v in body.items() if k != "created"}
    return [_timeless(item) for item in body] if isinstance(body, list) else body


def test_model_endpoints_and_probes_answer_as_the_instance(cluster):
    router, instance = cluster
    for path in ("/v1/models", f"/v1/models/{NAME}", "/v1/models/other"):
        via = httpx.get(router.url + path, headers=AUTH, timeout=10.0)
        direct = httpx.get(instance.url + path, headers=AUTH, timeout=10.0)
        assert (via.status_code, _timeless(via.json())) == (direct.status_code,
                                                            _timeless(direct.json()))
    assert httpx.get(f"{router.url}/v1/models", timeout=10.0).status_code == 401  # no key
    assert httpx.head(f"{router.url}/health", timeout=10.0).status_code == 200
    assert "version" in httpx.get(f"{router.url}/version", timeout=10.0).json()


def test_anthropic_clients_key_and_count_tokens_pass_through(cluster):
    router, instance = cluster
    key = {"x-api-key": KEY}
    body = {"model": NAME, "max_tokens": 3, "temperature": 0.0,
            "messages": [{"role": "user", "content": "Hello"}]}
    via = httpx.post(f"{router.url}/v1/messages", json=body, headers=key, timeout=30.0)
    direct = httpx.post(f"{instance.url}/v1/messages", json=body, headers=key, timeout=30.0)
    assert via.status_code == 200, via.text
    assert via.json()["content"] == direct.json()["content"]
    counted = httpx.post(f"{router.url}/v1/messages/count_tokens", json=body, headers=key,
                         timeout=30.0)
    assert counted.json() == {"input_tokens": via.json()["usage"]["input_tokens"]}
    # The instance's refusal, in Anthropic's shape, reaches the client as it was.
    refused = httpx.post(f"{router.url}/v1/messages", json=body, timeout=30.0)
    assert refused.status_code == 401
    assert refused.json()["error"]["type"] == "authentication_error"


def test_a_full_queue_s_503_reaches_the_client_with_its_retry_after(cluster):
    router, instance = cluster

    async def scenario() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=router.url, headers=AUTH, timeout=60.0) as client:
            tasks = [asyncio.create_task(client.post("/v1/completions", json=LONG))
                     for _ in range(4)]
            # One runs, one waits: the others are refused at once.
            done, pending = await asyncio.wait(tasks, timeout=30.0,
                                               return_when=asyncio.FIRST_COMPLETED)
            while len(done) < 2 and pending:
                more, pending = await asyncio.wait(pending, timeout=30.0,
                                                   return_when=asyncio.FIRST_COMPLETED)
                done |= more
            for task in pending:  # the client leaves: their requests end on the instance
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            return [task.result() for task in done]

    refused = asyncio.run(scenario())
    assert len(refused) >= 2 and all(r.status_code == 503 for r in refused)
    assert all(r.json()["error"]["code"] == "queue_full" and r.headers["retry-after"]
               for r in refused)
    _wait_idle(instance)


def test_a_client_that_leaves_cancels_its_request_on_the_instance(cluster):
    router, instance = cluster
    before = _instance_metric(instance, "vllm:generation_tokens_total")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{router.url}/v1/completions", json=LONG, headers=AUTH, timeout=1.0)
    _wait_idle(instance)
    assert _instance_metric(instance, "vllm:generation_tokens_total") - before < LONG[
        "max_tokens"]


def test_a_slow_answer_is_a_504_and_leaves_the_instance_in_routing(cluster):
    _, instance = cluster
    service = RouterService(RouterConfig(instances=(instance.url,), read_timeout_s=0.5,
                                         instance_api_key=KEY))

    async def scenario(service, client) -> None:
        await service.check(service.instances[0])
        response = await client.post("/v1/completions", json=LONG, headers=AUTH)
        assert response.status_code == 504
        assert response.json()["error"]["code"] == "upstream_timeout"
        assert service.instances[0].healthy

    asyncio.run(run_scenario(service, scenario))
    _wait_idle(instance)  # the closed connection ended the request there


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/messages"])
def test_an_instance_lost_mid_stream_ends_the_stream_with_an_error_event(model_dir, path):
    instance = _instance(model_dir)
    service = RouterService(RouterConfig(instances=(instance.url,)))
    body = {**LONG, "stream": True}
    if path == "/v1/messages":
        body = {**body, "messages": [{"role": "user", "content": "Go on"}]}
        del body["prompt"]

    async def scenario(service, client) -> None:
        await service.check(service.instances[0])
        asyncio.get_running_loop().call_later(1.0, instance.process.kill)
        response = await client.post(path, json=body)
        events = [line[len("data: "):] for line in response.text.splitlines()
                  if line.startswith("data: ")]
        assert len(events) > 1 and "[DONE]" not in events
        if path == "/v1/messages":  # Anthropic's error event, as its clients read it
            assert response.text.splitlines()[-3] == "event: error"
            assert json.loads(events[-1])["error"]["type"] == "api_error"
        else:
            assert json.loads(events[-1])["error"]["code"] == "upstream_failed"
        assert not service.instances[0].healthy

    try:
        asyncio.run(run_scenario(service, scenario))
    finally:
        instance.stop()
