"""How the router finds the instance that stores a response: only ids of a response's form
are looked for (never a path of the client's choosing), and an id no instance stores is not
looked for again at once (one request is not one look per instance, again and again)."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from kvtier.router.config import RouterConfig
from kvtier.router.responses import owner_of
from kvtier.router.service import RouterService

from .test_app import fake_instance

STORED = "resp_0123456789abcdef"


def counting_instance(looks: list[str]):
    def add_routes(app: FastAPI) -> None:
        @app.get("/v1/responses/{response_id}")
        async def stored(response_id: str) -> JSONResponse:
            looks.append(response_id)
            if response_id == STORED:
                return JSONResponse({"id": STORED})
            return JSONResponse({"error": {}}, status_code=404)

    return fake_instance({"publishing": False}, add_routes=add_routes)


def test_only_response_ids_are_looked_for_and_misses_are_remembered_a_while():
    looks: list[str] = []

    async def scenario(url: str) -> None:
        service = RouterService(RouterConfig(instances=(url,)))
        instance = service.instances[0]
        await service.check(instance)
        for bogus in ("../../health", "resp_x/../../health", "resp_" + "a" * 65, ""):
            assert await owner_of(service, bogus, {}) is None
        assert looks == []  # none of those reached the instance
        for _ in range(3):
            assert await owner_of(service, "resp_missing", {}) is None
        assert looks == ["resp_missing"]
        for _ in range(2):
            assert await owner_of(service, STORED, {}) is instance
        assert looks == ["resp_missing", STORED]  # then known
        await service.stop()

    with counting_instance(looks) as url:
        asyncio.run(scenario(url))
