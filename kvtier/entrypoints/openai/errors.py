"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}}.

Every failure a client can cause ends here as a JSON error with the field it concerns in
`param`; anything else becomes a 500 with the same shape, and the server keeps serving. On
the paths of Anthropic's Messages API the same errors take Anthropic's shape, {"type":
"error", "error": {"type", "message"}}, which its clients read.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvtier.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

# Seconds a client should wait before retrying a request refused for load.
RETRY_AFTER_S = 1
# The paths answered in Anthropic's dialect, and its error types by status.
ANTHROPIC_PATH = "/v1/messages"
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                    429: "rate_limit_error", 503: "overloaded_error"}


class APIError(Exception):
    """An error answered to the client as-is (status, OpenAI error body, extra headers)."""

    status_code = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def to_response(self, path: str = "") -> JSONResponse:
        """The error as the API of `path` writes errors."""
        if speaks_anthropic(path):
            body = anthropic_error_body(self)
        else:
            body = ErrorResponse(error=ErrorInfo(message=self.message, type=self.error_type,
                                                 param=self.param, code=self.code)).model_dump()
        return JSONResponse(body, status_code=self.status_code, headers=self.headers)


class BadRequestError(APIError):
    pass


class AuthenticationError(APIError):
    status_code = 401
    error_type = "authentication_error"


class NotFoundError(APIError):
    status_code = 404
    error_type = "not_found_error"


class ServiceUnavailableError(APIError):
    status_code = 503
    error_type = "service_unavailable_error"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message, code=code, headers={"Retry-After": str(RETRY_AFTER_S)})


class InternalServerError(APIError):
    status_code = 500
    error_type = "internal_server_error"


def speaks_anthropic(path: str) -> bool:
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def anthropic_error_body(error: APIError) -> dict[str, Any]:
    """Anthropic's bodies have no `param`: the message leads with the field, as Anthropic's
    own do ("max_tokens: Field required"), unless it names it already."""
    message = error.message
    if error.param is not None and error.param not in message:
        message = f"{error.param}: {message}"
    return {"type": "error", "error": {
        "type": _ANTHROPIC_TYPES.get(error.status_code,
                                     "invalid_request_error" if error.status_code < 500
                                     else "api_error"),
        "message": message}}


def anthropic_error_event(error: APIError) -> str:
    """The error as a server-sent event of an Anthropic stream (one that has started)."""
    body = json.dumps(anthropic_error_body(error), ensure_ascii=False)
    return f"event: error\ndata: {body}\n\n"


def param_from_location(location: tuple) -> str | None:
    """("body", "messages", 0, "content") -> "messages[0].content"."""
    parts = [p for p in location if p != "body"]
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or None


def body_path(error: Mapping[str, Any], body: Any) -> tuple:
    """Where in the request `body` (parsed JSON) a pydantic error is. Its location also holds
    a label for each union branch tried ("str", "list[TextPart]", "function-after[...]"),
    which is no key or index of the body there: what is neither is left out, but for a
    missing field's name (the location's last entry)."""
    location = tuple(error.get("loc", ()))
    if location[:1] == ("body",):
        location = location[1:]
    node, path = body, []
    for at, part in enumerate(location):
        if isinstance(node, dict) and part in node or isinstance(node, list) and \
                type(part) is int and 0 <= part < len(node):
            node = node[part]
            path.append(part)
        elif error.get("type") == "missing" and at == len(location) - 1:
            path.append(part)
    return tuple(path)


def validation_error(exc: RequestValidationError) -> BadRequestError:
    errors = exc.errors()
    if not errors:
        return BadRequestError("request body must be a JSON object", code="invalid_json")
    if errors[0].get("type") == "json_invalid":
        detail = errors[0].get("ctx", {}).get("error", errors[0].get("msg"))
        return BadRequestError(f"malformed JSON body: {detail}", code="invalid_json")
    # Of a union's branches, the one that got deepest into the value is the one its sender
    # meant (content: [{"text": 5}] is a list of parts with a bad text, not a bad string).
    paths = [body_path(error, exc.body) for error in errors]
    deepest = max(range(len(errors)), key=lambda i: len(paths[i]))
    first = errors[deepest]
    param = param_from_location(paths[deepest])
    message = first.get("msg", "invalid value")
    if param is None:  # the body itself: empty, null, or not an object
        return BadRequestError("request body must be a JSON object", code="invalid_json")
    if first.get("type") == "missing":
        return BadRequestError(f"missing required field '{param}'", param=param,
                               code="missing_required_parameter")
    return BadRequestError(f"invalid value for '{param}': {message}", param=param,
                           code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.to_response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).to_response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = APIError(str(exc.detail), code=str(exc.status_code))
        error.status_code = exc.status_code
        return error.to_response(request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error serving %s", request.url.path)
        return InternalServerError(f"internal server error: {exc!r}").to_response(
            request.url.path)
