"""Chat requests that other APIs (Responses, Messages) build from their own fields, and the
chat path's 400s in those APIs' names. Imports no torch: the router reads requests with it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from kvtier.entrypoints.openai.errors import BadRequestError, body_path, param_from_location
from kvtier.entrypoints.openai.protocol import ChatCompletionRequest


def renamed(param: str | None, renames: Mapping[str, str]) -> str | None:
    """A chat request's field (`param` of a 400) as an API that names its top-level field
    `renames[field]` calls it."""
    if param is None:
        return None
    return renames.get(param.split(".")[0].split("[")[0], param)


def chat_request_of(fields: dict[str, Any], renames: Mapping[str, str]) -> ChatCompletionRequest:
    """The chat request of `fields`; a 400 naming the field as the API calls it (`renames`)."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = renamed(param_from_location(body_path(first, fields)), renames)
        raise BadRequestError(f"invalid value for '{param}': {first.get('msg')}", param=param,
                              code="invalid_value") from exc
