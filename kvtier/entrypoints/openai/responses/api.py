"""POST /v1/responses, and GET / DELETE of stored responses and their input items."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvtier.engine.outputs import CompletionOutput, RequestOutput
from kvtier.entrypoints.openai.chat import ChatPlan, plan_chat
from kvtier.entrypoints.openai.connection import REQUEST_ID_HEADER, base_request_id
from kvtier.entrypoints.openai.context import ServerContext
from kvtier.entrypoints.openai.errors import APIError, BadRequestError, NotFoundError
from kvtier.entrypoints.openai.generation import (
    Outputs,
    finals_or_none,
    open_or_none,
    output_error,
    to_api_error,
)
from kvtier.entrypoints.openai.logprobs import chat_logprobs
from kvtier.entrypoints.openai.prompts import check_text
from kvtier.entrypoints.openai.reasoning import ReasoningStream, split_reasoning
from kvtier.entrypoints.openai.responses.convert import (
    Message,
    assistant_message,
    chat_request,
    check_request,
    input_messages,
    new_id,
    responses_param,
    with_instructions,
)
from kvtier.entrypoints.openai.responses.items import (
    Answer,
    finish,
    num_reasoning_tokens,
    output_items,
    usage,
)
from kvtier.entrypoints.openai.responses.protocol import ResponseObject, ResponsesRequest
from kvtier.entrypoints.openai.responses.store import ResponseStore, StoredResponse
from kvtier.entrypoints.openai.responses.stream import ResponseEvents
from kvtier.entrypoints.openai.streaming import SSE_HEADERS, DeltaTracker
from kvtier.entrypoints.openai.tools import ParsedAnswer, ToolStream, parse_answer

router = APIRouter()
# Input items one GET .../input_items page may hold.
_MAX_ITEMS_PAGE = 100


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, raw: Request) -> Response:
    ctx: ServerContext = raw.app.state.ctx
    check_text(body)  # first: an error message quoting a bad string could not be sent
    check_request(body)
    conversation = [*_previous_messages(ctx.response_store, body.previous_response_id),
                    *input_messages(body.input)]
    plan = await _plan(ctx, body, conversation)
    ctx.metrics.observe_params(plan.params.n, plan.params.max_tokens)
    response_id = new_id("resp")
    shell = _shell(ctx, body, response_id)
    generations = await open_or_none(raw, ctx, [plan.prompt], plan.params, [response_id],
                                     plan.options)
    if generations is None:
        return Response(status_code=499)
    headers = {REQUEST_ID_HEADER: base_request_id(raw)}
    keep = _Keeper(ctx.response_store, body, conversation)
    if body.stream:
        return StreamingResponse(_stream(ctx, plan, generations[0], shell, keep),
                                 media_type="text/event-stream",
                                 headers={**SSE_HEADERS, **headers})
    finals = await finals_or_none(raw, generations)
    if finals is None:
        return Response(status_code=499)
    final = finals[0]
    completion = final.outputs[0]
    answer = _answer(ctx, plan, completion)
    logprobs = None if completion.logprobs is None else chat_logprobs(
        ctx.tokenizer, completion.token_ids, completion.logprobs, plan.params.logprobs or 0
    ).content
    response = finish(shell, output_items(answer, logprobs), completion.finish_reason,
                      _usage(ctx, plan, final, completion))
    keep(response, answer)
    return JSONResponse(response.model_dump(mode="json"), headers=headers)


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


def _previous_messages(store: ResponseStore, response_id: str | None) -> list[Message]:
    if response_id is None:
        return []
    stored = store.get(response_id)
    if stored is None:
        raise NotFoundError(f"previous_response_id {response_id!r}: no such response is "
                            "stored here (it was made with store false, deleted, made by "
                            "another instance, or dropped to make room: "
                            "--responses-store-size)", param="previous_response_id",
                            code="previous_response_not_found")
    return list(stored.messages)


async def _plan(ctx: ServerContext, body: ResponsesRequest,
                conversation: list[Message]) -> ChatPlan:
    """The chat plan over the instructions and the conversation. With truncation "auto", a
    conversation too long for the context loses its oldest turns (from a user message on)
    until it fits, the fewest that do."""
    try:
        return await _plan_messages(ctx, body, with_instructions(body.instructions,
                                                                 conversation))
    except BadRequestError as exc:
        if body.truncation != "auto" or exc.code != "context_length_exceeded":
            raise
        starts = [i for i, m in enumerate(conversation) if i > 0 and m["role"] == "user"]
        # Binary search for the earliest turn the rest fits from.
        low, high, best = 0, len(starts) - 1, None
        while low <= high:
            middle = (low + high) // 2
            try:
                best = await _plan_messages(ctx, body, with_instructions(
                    body.instructions, conversation[starts[middle]:]))
                high = middle - 1
            except BadRequestError as retry:
                if retry.code != "context_length_exceeded":
                    raise
                low = middle + 1
        if best is None:
            raise
        return best


async def _plan_messages(ctx: ServerContext, body: ResponsesRequest,
                         messages: list[Message]) -> ChatPlan:
    try:
        return await plan_chat(ctx, chat_request(body, messages), "input",
                               "max_output_tokens")
    except APIError as exc:  # the chat path names chat fields
        exc.param = responses_param(exc.param)
        raise


def _shell(ctx: ServerContext, body: ResponsesRequest, response_id: str) -> ResponseObject:
    """The response before its answer: the request's settings, echoed."""
    return ResponseObject(
        id=response_id, model=ctx.response_model(body.model), instructions=body.instructions,
        max_output_tokens=body.max_output_tokens,
        previous_response_id=body.previous_response_id, reasoning=body.reasoning,
        store=body.store and ctx.response_store.max_bytes > 0, temperature=body.temperature,
        top_p=body.top_p, top_logprobs=body.top_logprobs,
        text=body.text or {"format": {"type": "text"}},
        tool_choice=body.tool_choice or ("auto" if body.tools else "none"),
        tools=body.tools or [], parallel_tool_calls=body.parallel_tool_calls is not False,
        truncation=body.truncation, user=body.user, metadata=body.metadata or {})


def _answer(ctx: ServerContext, plan: ChatPlan, completion: CompletionOutput) -> Answer:
    reasoning, content = split_reasoning(ctx.reasoning_parser, completion.text, plan.closed)
    parsed = parse_answer(plan.tools, content) if content is not None \
        else ParsedAnswer(None, [])
    return Answer(reasoning, parsed.content, parsed.tool_calls, completion.finish_reason)


def _usage(ctx: ServerContext, plan: ChatPlan, final: RequestOutput,
           completion: CompletionOutput) -> Any:
    return usage(ctx, len(plan.prompt.token_ids), len(completion.token_ids),
                 final.num_cached_tokens,
                 num_reasoning_tokens(ctx, completion.token_ids, plan.closed))


class _Keeper:
    """Stores a finished response with its conversation, when the request asked for it."""

    def __init__(self, store: ResponseStore, body: ResponsesRequest,
                 conversation: list[Message]) -> None:
        self.store = store
        self.body = body
        self.conversation = conversation

    def __call__(self, response: ResponseObject, answer: Answer) -> None:
        if not response.store:
            return
        messages = [*self.conversation, assistant_message(answer.content, answer.calls)]
        self.store.put(response.id, StoredResponse(response.model_dump(mode="json"), messages,
                                                   _input_items(self.body.input)))


def _input_items(value: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The request's input as items with ids, as GET .../input_items lists them."""
    if isinstance(value, str):
        value = [{"type": "message", "role": "user",
                  "content": [{"type": "input_text", "text": value}]}]
    return [{"id": new_id("msg" if item.get("type", "message") == "message" else "item"),
             **item} for item in value or ()]


async def _stream(ctx: ServerContext, plan: ChatPlan, outputs: Outputs, shell: ResponseObject,
                  keep: _Keeper) -> AsyncIterator[str]:
    events = ResponseEvents(shell)
    for line in events.start():
        yield line
    steps = _StreamSteps(ctx, plan, events)
    try:
        async for output in outputs:
            error = output_error(output)
            lines = events.fail(error) if error is not None else steps.lines(output)
            if steps.answer is not None:  # kept before the client has the last event
                keep(events.response, steps.answer)
            for line in lines:
                yield line
            if error is not None:
                return
    except Exception as exc:  # the stream has started: report in-band, then end it
        for line in events.fail(to_api_error(exc)):
            yield line


class _StreamSteps:
    """Each engine output of a streamed response as the events it adds."""

    def __init__(self, ctx: ServerContext, plan: ChatPlan, events: ResponseEvents) -> None:
        self.ctx, self.plan, self.events = ctx, plan, events
        self.tracker, self.tools = DeltaTracker(), ToolStream(plan.tools)
        self.reasoning = ReasoningStream(ctx.reasoning_parser, plan.closed)
        self.pending: list[Any] = []  # logprobs of tokens whose text is not sent yet
        self.answer: Answer | None = None  # once finished

    def lines(self, output: RequestOutput) -> list[str]:
        completion = output.outputs[0]
        delta = self.tracker.advance(0, completion)
        if delta is None:
            return []
        if delta.logprobs is not None:
            self.pending += chat_logprobs(self.ctx.tokenizer, delta.token_ids, delta.logprobs,
                                          self.plan.params.logprobs or 0).content
        done = delta.finish_reason is not None
        thought, answer = self.reasoning.step(0, completion.text, done)
        content, calls, _ = self.tools.step(0, answer, delta.finish_reason)
        events = self.events
        lines = events.reasoning(thought) if thought else []
        # The last tokens' logprobs go with the message (as unstreamed: none without one,
        # and an answer of nothing else is one message).
        if content or done and self.pending and not calls and (events.writing_text
                                                                or not events.items):
            lines += events.text(content, self.pending)
            self.pending = []
        if calls:
            lines += events.calls(calls)
        if done:
            self.answer = _answer(self.ctx, self.plan, completion)
            lines += events.finish(finish(events.response, events.items,
                                          completion.finish_reason,
                                          _usage(self.ctx, self.plan, output, completion)))
        return lines
