"""The router's HTTP front-end in-process, in front of an address where nothing listens."""

from __future__ import annotations

import asyncio

import httpx

from kvtier.router.app import build_app
from kvtier.router.config import RouterConfig
from kvtier.router.service import RouterService

from ..entrypoints.server_process import free_port


def run_against_dead_instance(scenario) -> None:
    config = RouterConfig(instances=(f"http://127.0.0.1:{free_port()}",), max_health_failures=2)
    service = RouterService(config)
    app = build_app(service)

    async def main() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            try:
                await scenario(service, client)
            finally:
                await service.stop()

    asyncio.run(main())


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
