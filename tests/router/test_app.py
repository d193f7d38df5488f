"""The router's HTTP front-end in-process, in front of an address where nothing listens."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import uvicorn
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from kvtier.engine.kv_events import KVEventsConfig, ZmqEventPublisher
from kvtier.kv import AllBlocksCleared, BlockRemoved
from kvtier.router.config import RouterConfig
from kvtier.router.service import RouterService

from ..entrypoints.server_process import free_port
from ..tiny_models import save_byte_tokenizer
from .asgi_client import run_scenario


@contextlib.contextmanager
def fake_instance(info: dict, metrics: str = "", add_routes=None):
    """An instance's routes the router reads (/health, /metrics, /v1/kv_events_info answering
    `info`, which the test may change), and any `add_routes(app)` adds, served on a free
    port; yields its URL."""
    app = FastAPI()
    app.get("/health")(lambda: {})
    app.get("/metrics")(lambda: PlainTextResponse(metrics))
    app.get("/v1/kv_events_info")(lambda: info)
    if add_routes is not None:
        add_routes(app)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10.0
        while not server.started:
            assert time.monotonic() < deadline, "the fake instance did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def run_against_dead_instance(scenario) -> None:
    config = RouterConfig(instances=(f"http://127.0.0.1:{free_port()}",), max_health_failures=2)
    asyncio.run(run_scenario(RouterService(config), scenario))


def test_without_a_healthy_instance_requests_get_a_503_naming_it():
    async def scenario(service, client):
        await service.check(service.instances[0])
        assert not service.instances[0].healthy
        response = await client.post("/v1/completions", json={"prompt": "hi"})
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "no_instance"
        assert (await client.get("/health")).status_code == 503
        bad = await client.post("/v1/completions", content=b"{not json")
        assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
        assert (await client.post("/v1/completions", json=[1])).status_code == 400

    run_against_dead_instance(scenario)


def test_an_unreachable_instance_is_marked_down_and_the_request_fails_cleanly():
    async def scenario(service, client):
        instance = service.instances[0]
        instance.healthy = True  # it answered once, then went away
        response = await client.post("/v1/completions", json={"prompt": "hi"})
        assert response.status_code == 502
        assert response.json()["error"]["code"] == "upstream_failed"
        assert not instance.healthy and instance.in_flight == 0
        metrics = (await client.get("/metrics")).text
        assert 'kvtier_router:retries_total{reason="unreachable"} 1.0' in metrics
        assert 'kvtier_router:decisions_total{policy="kv-aware",reason="no_hit"} 1.0' in metrics
        assert "kvtier_router:index_blocks 0.0" in metrics
        explained = await client.post("/router/explain", json={"path": "/v1/x", "body": {}})
        assert explained.status_code == 400

    run_against_dead_instance(scenario)


def test_an_instance_that_stops_publishing_is_reindexed_from_its_replay_buffer(tmp_path):
    """The instance side is a real event publisher behind the HTTP routes the router reads
    (a real `kvtier serve` cannot be made to serve requests yet publish nothing)."""
    save_byte_tokenizer(tmp_path)
    publisher = ZmqEventPublisher(KVEventsConfig(
        enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{free_port()}",
        replay_endpoint=f"tcp://127.0.0.1:{free_port()}"))
    info = {"publishing": True, "endpoint": publisher.config.endpoint,
            "replay_endpoint": publisher.config.replay_endpoint, "topic": "",
            "block_size": 16, "hash_algo": "sha256_cbor", "model": str(tmp_path)}
    # vLLM 0.32's breakdown of the waiting requests by reason is not counted twice.
    metrics = ('vllm:num_requests_running 2.0\nvllm:num_requests_waiting{model_name="m"} 1.0\n'
               'vllm:num_requests_waiting_by_reason{reason="capacity"} 1.0\n')

    async def until(condition) -> None:
        deadline = time.monotonic() + 10.0
        while not condition():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)

    async def scenario(url: str) -> None:
        service = RouterService(RouterConfig(instances=(url,), event_timeout_s=0.2))
        instance = service.instances[0]
        await service.check(instance)
        assert (instance.healthy, instance.indexed, instance.reported_load) == (True, True, 3)
        await asyncio.sleep(0.3)  # the subscription reaches the PUB socket
        publisher.publish([BlockRemoved([bytes(32)], "device", 0), AllBlocksCleared()])
        await until(lambda: instance.last_event_at is not None)
        service.index.store(instance.slot, [7], "GPU")
        # A request computed new blocks 1 s ago and no event followed: silent.
        instance.awaiting_events_since = time.monotonic() - 1.0
        await service.check(instance)
        assert len(service.index) == 0 and instance.indexed
        label = f'instance="{instance.url}"'
        metrics = service.metrics.render().decode()
        assert f'kvtier_router:instance_drops_total{{{label},reason="silent"}} 1.0' in metrics
        # Subscribed afresh: its next batch brings back everything the replay buffer holds.
        await asyncio.sleep(0.3)
        publisher.publish([AllBlocksCleared()])
        # 3 batches: the first, then the replayed first and the new one.
        await until(lambda: f"event_batches_total{{{label}}} 3.0"
                    in service.metrics.render().decode())
        await service.stop()

    try:
        with fake_instance(info, metrics) as url:
            asyncio.run(scenario(url))
    finally:
        publisher.shutdown()


def test_adapters_loaded_at_run_time_reach_the_prompt_hasher(tmp_path):
    """Each health check reads the instance's kv_events_info again: an adapter loaded there
    after it came up hashes with its key from the next check on."""
    save_byte_tokenizer(tmp_path)
    info = {"publishing": True, "endpoint": f"tcp://127.0.0.1:{free_port()}", "topic": "",
            "block_size": 4, "hash_algo": "sha256_cbor", "model": str(tmp_path),
            "lora_adapters": {"a": "key-a"}}
    token_ids = list(range(3, 20))

    async def scenario(url: str) -> None:
        service = RouterService(RouterConfig(instances=(url,)))
        await service.check(service.instances[0])
        hasher = service.hasher
        base = hasher.block_hashes_of(token_ids)
        assert hasher.block_hashes_of(token_ids, None, "a") != base
        assert hasher.block_hashes_of(token_ids, None, "b") == base  # not known yet
        info["lora_adapters"] = {"a": "key-a", "b": "key-b"}
        await service.check(service.instances[0])
        with_b = hasher.block_hashes_of(token_ids, None, "b")
        assert with_b != base and with_b != hasher.block_hashes_of(token_ids, None, "a")
        await service.stop()

    with fake_instance(info) as url:
        asyncio.run(scenario(url))


def test_events_info_that_failed_when_the_instance_came_up_is_read_again(tmp_path):
    """One malformed (or failed) kv_events_info answer at bring-up must not leave a healthy
    instance unindexed for as long as it stays up: it is read again, backing off."""
    save_byte_tokenizer(tmp_path)
    info = {"publishing": True}  # no endpoint: malformed

    async def scenario(url: str) -> None:
        service = RouterService(RouterConfig(instances=(url,), health_interval_s=0.05))
        instance = service.instances[0]
        await service.check(instance)
        assert instance.healthy and instance.events is None and not instance.indexed
        first_retry = instance.info_retry_at
        await service.check(instance)  # before the retry time: not read again
        assert instance.info_retry_at == first_retry
        info.update(endpoint=f"tcp://127.0.0.1:{free_port()}", topic="", block_size=16,
                    hash_algo="sha256_cbor", model=str(tmp_path))
        await asyncio.sleep(max(0.0, first_retry - time.monotonic()) + 0.01)
        await service.check(instance)
        assert instance.events is not None and instance.indexed
        assert instance.info_retry_at is None
        await service.stop()

    with fake_instance(info) as url:
        asyncio.run(scenario(url))


def test_lost_events_also_forget_the_shared_stores_blocks():
    """Any instance publishes the shared stores' removals: after a gap that could not be
    filled, their blocks are not known to be there any more."""
    service = RouterService(RouterConfig(instances=("http://127.0.0.1:1", "http://127.0.0.1:2")))
    first, second = service.instances
    service.index.store(first.slot, [1, 2], "CPU")
    service.index.store(second.slot, [3], "CPU")
    service.index.store(first.slot, [1, 2, 4], "obj", "remote")
    service._reset(first, "lost")
    assert service.index.match([1, 2, 4], [first.slot, second.slot])[second.slot].num_blocks == 0
    assert service.index.match([3], [second.slot])[second.slot].num_blocks == 1
