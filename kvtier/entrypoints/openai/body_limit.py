"""A cap on request body size, enforced before anything reads the body into a request."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvtier.entrypoints.openai.errors import APIError

# Far above any prompt the context can hold (a 128k-token prompt as JSON token ids is ~1 MiB),
# far below what would strain the HTTP loop to parse.
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 1024 * 1024


class PayloadTooLargeError(APIError):
    status_code = 413


class BodyLimitMiddleware:
    """413 for a body over `max_bytes`: a declared Content-Length is refused unread, and a
    chunked body is read only up to the limit. Plain ASGI, so streaming responses and
    disconnect detection pass through untouched."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        first = await self._read_body(receive)
        if first is None:
            await self._refuse(scope, receive, send)
            return
        await self.app(scope, _replay(first, receive), send)

    async def _read_body(self, receive: Receive) -> Message | None:
        """The whole body as one message (or the disconnect that cut it short); None once it
        passes the limit."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return message
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = PayloadTooLargeError(
            f"the request body is larger than this server's limit of {self.max_bytes} bytes "
            "(--max-request-body-bytes)", code="request_too_large",
            headers={"Connection": "close"})
        await error.to_response(scope["path"])(scope, receive, send)


def _replay(first: Message, receive: Receive) -> Receive:
    """`receive` that hands out the buffered body once, then the connection's own messages
    (the disconnect)."""
    pending = [first]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed
