"""The router's HTTP front-end: the OpenAI endpoints, proxied; its own health and metrics."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

import kvtier
from kvtier.entrypoints.openai.body_limit import DEFAULT_MAX_REQUEST_BODY_BYTES, BodyLimitMiddleware
from kvtier.entrypoints.openai.errors import ServiceUnavailableError, install_error_handlers
from kvtier.router.instances import Instance
from kvtier.router.policy import NoInstanceError
from kvtier.router.prompts import CHAT_PATH, COMPLETIONS_PATH, MESSAGES_PATH, RESPONSES_PATH
from kvtier.router.proxy import explain, from_any_instance, proxy
from kvtier.router.responses import at_owner
from kvtier.router.service import RouterService


def build_app(service: RouterService,
              max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await service.start()
        yield
        await service.stop()

    app = FastAPI(title="kvtier router", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)

    _add_generation_routes(app, service)

    @app.get("/v1/models")
    async def models(raw: Request) -> Response:
        """The first healthy instance's list: every instance serves the same model."""
        return await from_any_instance(service, "/v1/models", raw)

    @app.get("/v1/models/{model:path}")
    async def model(model: str, raw: Request) -> Response:
        return await from_any_instance(service, f"/v1/models/{model}", raw)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": kvtier.__version__})

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        """200 while at least one instance that answers requests (in P/D mode, a decode
        instance) is healthy."""
        if not any(i.healthy for i in service.router.instances):
            raise ServiceUnavailableError("no instance is healthy", code="no_instance")
        return Response(status_code=200)

    @app.get("/router/instances")
    async def instances() -> JSONResponse:
        """Each instance's state as the router sees it, and the index's size."""
        return JSONResponse({"index_blocks": len(service.index),
                             "instances": [_state_of(i) for i in service.instances]})

    @app.post("/router/explain")
    async def explain_route(raw: Request) -> JSONResponse:
        """The decision for {"path": ..., "body": ...} and each instance's cached prefix."""
        try:
            return JSONResponse(await explain(service, raw))
        except NoInstanceError as exc:
            raise ServiceUnavailableError(str(exc), code="no_instance") from exc

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_body_bytes)
    return app


def _add_generation_routes(app: FastAPI, service: RouterService) -> None:
    """The proxied generation endpoints, and the stored responses where they live."""
    @app.post(COMPLETIONS_PATH)
    async def completions(raw: Request) -> Response:
        return await proxy(service, COMPLETIONS_PATH, raw)

    @app.post(CHAT_PATH)
    async def chat(raw: Request) -> Response:
        return await proxy(service, CHAT_PATH, raw)

    @app.post(RESPONSES_PATH)
    async def responses(raw: Request) -> Response:
        return await proxy(service, RESPONSES_PATH, raw)

    @app.post(MESSAGES_PATH)
    async def messages(raw: Request) -> Response:
        return await proxy(service, MESSAGES_PATH, raw)

    @app.post(MESSAGES_PATH + "/count_tokens")
    async def count_tokens(raw: Request) -> Response:
        return await from_any_instance(service, MESSAGES_PATH + "/count_tokens", raw)

    @app.api_route(RESPONSES_PATH + "/{response_id}", methods=["GET", "DELETE"])
    async def stored_response(response_id: str, raw: Request) -> Response:
        return await at_owner(service, raw.method, response_id, "", raw)

    @app.get(RESPONSES_PATH + "/{response_id}/input_items")
    async def input_items(response_id: str, raw: Request) -> Response:
        return await at_owner(service, "GET", response_id, "/input_items", raw)


def _state_of(instance: Instance) -> dict[str, object]:
    return {"url": instance.url, "role": instance.role, "healthy": instance.healthy,
            "indexed": instance.indexed, "transport_address": instance.transport_address,
            "in_flight": instance.in_flight, "reported_load": instance.reported_load,
            "queued_tokens": instance.queued_tokens}
