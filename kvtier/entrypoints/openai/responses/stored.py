"""Stored responses: kept after their answer, read and dropped by id (GET / DELETE
/v1/responses/{id}, GET /v1/responses/{id}/input_items), and the conversation a request that
names one as its `previous_response_id` goes on from."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse

from kvtier.entrypoints.openai.errors import BadRequestError, NotFoundError
from kvtier.entrypoints.openai.responses.convert import (
    Message,
    assistant_message,
    input_items,
)
from kvtier.entrypoints.openai.responses.items import Answer
from kvtier.entrypoints.openai.responses.protocol import ResponseObject, ResponsesRequest
from kvtier.entrypoints.openai.responses.store import ResponseStore, StoredResponse

router = APIRouter()
# Input items one GET .../input_items page may hold.
_MAX_ITEMS_PAGE = 100


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, raw: Request) -> JSONResponse:
    return JSONResponse(_stored(raw, response_id).response)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, raw: Request) -> JSONResponse:
    _stored(raw, response_id)
    raw.app.state.ctx.response_store.delete(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(response_id: str, raw: Request,
                           limit: int = Query(20, ge=1, le=_MAX_ITEMS_PAGE),
                           order: Literal["asc", "desc"] = "desc",
                           after: str | None = None) -> JSONResponse:
    """The request's own input items (not those of earlier responses), a page at a time."""
    items = list(_stored(raw, response_id).input_items)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise BadRequestError(f"after: no input item {after!r} in this response",
                                  param="after", code="invalid_value")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return JSONResponse({"object": "list", "data": page,
                         "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None,
                         "has_more": len(items) > limit})


def _stored(raw: Request, response_id: str) -> StoredResponse:
    stored = raw.app.state.ctx.response_store.get(response_id)
    if stored is None:
        raise NotFoundError(f"no stored response with id {response_id!r}", param="response_id",
                            code="response_not_found")
    return stored


def previous_messages(store: ResponseStore, response_id: str | None) -> list[Message]:
    """The conversation a request goes on from; 400 (as OpenAI answers) for an id not stored
    here."""
    if response_id is None:
        return []
    stored = store.get(response_id)
    if stored is None:
        raise BadRequestError(f"previous_response_id {response_id!r}: no such response is "
                              "stored here (it was made with store false, deleted, made by "
                              "another instance, or dropped to make room: "
                              "--responses-store-size)", param="previous_response_id",
                              code="previous_response_not_found")
    return list(stored.messages)


class Keeper:
    """Stores a finished response with its conversation, when the request asked for it."""

    def __init__(self, store: ResponseStore, body: ResponsesRequest,
                 conversation: list[Message]) -> None:
        self.store = store
        self.body = body
        self.conversation = conversation

    def __call__(self, response: ResponseObject, answer: Answer) -> ResponseObject:
        """The response as the client gets it: `store` false when it was not kept (asked
        not to be, or larger than the whole store)."""
        if not response.store:
            return response
        messages = [*self.conversation, assistant_message(answer.content, answer.calls)]
        stored = StoredResponse(response.model_dump(mode="json"), messages,
                                input_items(self.body.input))
        if self.store.put(response.id, stored):
            return response
        return response.model_copy(update={"store": False})
