"""The FastAPI application: routes, API key check, HTTP metrics, error bodies, shutdown."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvtier.entrypoints.anthropic import api as messages
from kvtier.entrypoints.openai import chat, completions, lora, system, tokenize
from kvtier.entrypoints.openai.body_limit import DEFAULT_MAX_REQUEST_BODY_BYTES, BodyLimitMiddleware
from kvtier.entrypoints.openai.context import ServerContext
from kvtier.entrypoints.openai.errors import AuthenticationError, install_error_handlers
from kvtier.entrypoints.openai.responses import api as responses

# Only the model API needs the key; probes (/health, /metrics, /version) stay open, as in vLLM.
# The model API, and the tokenizer endpoints (they run the chat template and the tokenizer on
# a client's text; vLLM leaves them open).
_PROTECTED_PREFIXES = ("/v1", "/tokenize", "/detokenize")


def build_app(ctx: ServerContext, shutdown_timeout_s: float = 30.0,
              max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES) -> FastAPI:
    """shutdown_timeout_s: how long shutdown lets in-flight engine requests finish;
    max_request_body_bytes: larger bodies get a 413 unread."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        # Off the event loop: draining waits on the engine thread.
        await asyncio.to_thread(ctx.async_llm.shutdown, shutdown_timeout_s)
        ctx.tokenize_executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="kvtier", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.ctx = ctx
    install_error_handlers(app)
    for module in (completions, chat, responses, messages, system, tokenize):
        app.include_router(module.router)
    if lora.runtime_updating_allowed():
        app.include_router(lora.router)

    # Added last runs first: the key check, then metrics (which count 413s), then the limit.
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_body_bytes)
    app.add_middleware(HTTPMetricsMiddleware, ctx=ctx)
    if ctx.api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=ctx.api_key)
    return app


class APIKeyMiddleware:
    """401 for model API and tokenizer requests without `Authorization: Bearer <key>` or, as
    Anthropic's clients send it, `x-api-key: <key>` (plain ASGI, so streaming responses and
    disconnect detection pass through untouched)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(_PROTECTED_PREFIXES) and \
                not self._has_key(Headers(scope=scope)):
            error = AuthenticationError("invalid or missing API key; send 'Authorization: "
                                        "Bearer <key>' or 'x-api-key: <key>'",
                                        code="invalid_api_key")
            await error.to_response(scope["path"])(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _has_key(self, headers: Headers) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), self.api_key):
            return True
        key = headers.get("x-api-key")
        return key is not None and hmac.compare_digest(key.encode(), self.api_key)


class HTTPMetricsMiddleware:
    """Counts requests as http_requests_total{handler, method, status}."""

    def __init__(self, app: ASGIApp, ctx: ServerContext) -> None:
        self.app = app
        self.ctx = ctx

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]

        async def capture(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, capture)
        finally:
            # The matched route's template, never the raw path (bounded label values).
            route = getattr(scope.get("route"), "path", "unmatched")
            self.ctx.metrics.http_requests.labels(
                handler=route, method=scope["method"], status=f"{status[0] // 100}xx").inc()
