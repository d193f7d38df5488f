"""GET /v1/models[/{model}], /v1/kv_events_info, /v1/kv_transfer_info, /health (and HEAD),
/version, /metrics."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

import kvtier
from kvtier.entrypoints.openai.context import ServerContext
from kvtier.entrypoints.openai.errors import ServiceUnavailableError
from kvtier.entrypoints.openai.protocol import ModelCard, ModelList

router = APIRouter()


def _ctx(raw: Request) -> ServerContext:
    return raw.app.state.ctx


def _card(ctx: ServerContext, name: str) -> ModelCard:
    lora = ctx.lora_modules.get(name)
    if lora is not None:
        return ModelCard(id=name, root=lora.lora_path,
                         parent=ctx.lora_parents.get(name, ctx.model_name),
                         max_model_len=ctx.max_model_len)
    return ModelCard(id=name, root=ctx.model_path or ctx.engine.model_name,
                     max_model_len=ctx.max_model_len)


@router.get("/v1/models")
async def list_models(raw: Request) -> JSONResponse:
    """The served names, then the LoRA adapters."""
    ctx = _ctx(raw)
    cards = [_card(ctx, name) for name in (*ctx.served_model_names, *ctx.lora_modules)]
    return JSONResponse(ModelList(data=cards).model_dump())


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, raw: Request) -> JSONResponse:
    ctx = _ctx(raw)
    ctx.check_model(model)
    return JSONResponse(_card(ctx, model).model_dump())


@router.get("/v1/kv_events_info")
async def kv_events_info(raw: Request) -> JSONResponse:
    """Where this server publishes its KV events and how it names blocks (for a router; with
    its LoRA adapters' keys): {"publishing": false} when it publishes none."""
    ctx = _ctx(raw)
    if ctx.kv_events_info is None:
        return JSONResponse({"publishing": False})
    loras = ctx.engine.loras
    adapters = {} if loras is None else {a.name: a.cache_key for a in loras.adapters()}
    return JSONResponse({**ctx.kv_events_info, "lora_adapters": adapters})


@router.get("/v1/kv_transfer_info")
async def kv_transfer_info(raw: Request) -> JSONResponse:
    """This server's KV connector and role, and where its transfer engine listens (a router
    gives a decode instance's address to the prefill instance that sends it the prompt's KV):
    {"kv_connector": null} without a connector."""
    engine = _ctx(raw).engine
    transfer = engine.config.kv_transfer_config
    if transfer is None:
        return JSONResponse({"kv_connector": None})
    return JSONResponse({"kv_connector": transfer.kv_connector, "kv_role": transfer.kv_role,
                         "transport_address": _transport_address(engine.runner.connector)})


def _transport_address(connector: Any) -> str | None:
    """The address of the P2PConnector's transfer engine, inside a MultiConnector too."""
    from kvtier.connector.multi import MultiConnectorWorker
    from kvtier.connector.p2p import P2PConnectorWorker

    if isinstance(connector, P2PConnectorWorker):
        return connector.address
    if isinstance(connector, MultiConnectorWorker):
        return next(filter(None, map(_transport_address, connector.children)), None)
    return None


@router.api_route("/health", methods=["GET", "HEAD"])
async def health(raw: Request) -> Response:
    """200 while the engine loop runs; 503 once it has stopped (a load balancer drains us)."""
    if not _ctx(raw).async_llm.is_running:
        raise ServiceUnavailableError("the engine loop is not running", code="engine_dead")
    return Response(status_code=200)


@router.get("/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": kvtier.__version__})


@router.get("/metrics")
async def metrics(raw: Request) -> Response:
    ctx = _ctx(raw)
    # vLLM's labels on every series, so dashboards and alerts written for vLLM select them.
    labels = {"model_name": ctx.model_name, "engine": "0"}
    return Response(ctx.engine.metrics.render(labels), media_type=CONTENT_TYPE_LATEST)
