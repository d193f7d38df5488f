"""POST /v1/responses (and, from stored.py, the routes of stored responses)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvtier.engine.outputs import CompletionOutput, RequestOutput
from kvtier.entrypoints.openai.chat import ChatPlan, plan_chat
from kvtier.entrypoints.openai.connection import REQUEST_ID_HEADER, base_request_id
from kvtier.entrypoints.openai.context import ServerContext
from kvtier.entrypoints.openai.errors import APIError, BadRequestError
from kvtier.entrypoints.openai.generation import (
    Outputs,
    finals_or_none,
    open_or_none,
    output_error,
    to_api_error,
)
from kvtier.entrypoints.openai.logprobs import chat_logprobs
from kvtier.entrypoints.openai.prompts import PER_MESSAGE_CHARS, check_text
from kvtier.entrypoints.openai.protocol import ChatCompletionRequest, ChatTokenLogProb
from kvtier.entrypoints.openai.reasoning import ReasoningStream, split_reasoning
from kvtier.entrypoints.openai.responses import stored
from kvtier.entrypoints.openai.responses.convert import (
    Message,
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
from kvtier.entrypoints.openai.responses.protocol import (
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from kvtier.entrypoints.openai.responses.stored import Keeper, previous_messages
from kvtier.entrypoints.openai.responses.stream import ResponseEvents
from kvtier.entrypoints.openai.streaming import DeltaTracker, sse_response
from kvtier.entrypoints.openai.tools import ParsedAnswer, ToolStream, parse_answer

router = APIRouter()
router.include_router(stored.router)


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, raw: Request) -> Response:
    ctx: ServerContext = raw.app.state.ctx
    check_text(body)  # first: an error message quoting a bad string could not be sent
    check_request(body)
    conversation = [*previous_messages(ctx.response_store, body.previous_response_id),
                    *input_messages(body.input)]
    plan = await _plan(ctx, body, conversation)
    ctx.metrics.observe_params(plan.params.n, plan.params.max_tokens)
    response_id = new_id("resp")
    shell = _shell(ctx, body, response_id)
    try:
        generations = await open_or_none(raw, ctx, [plan.prompt], plan.params, [response_id],
                                         plan.options, constraint_param=plan.constraint_param)
    except APIError as exc:  # a constraint that does not compile names a chat field
        exc.param = responses_param(exc.param)
        raise
    if generations is None:
        return Response(status_code=499)
    headers = {REQUEST_ID_HEADER: base_request_id(raw)}
    keep = Keeper(ctx.response_store, body, conversation)
    if body.stream:
        return sse_response(_stream(ctx, plan, generations[0], shell, keep), headers)
    finals = await finals_or_none(raw, generations)
    if finals is None:
        return Response(status_code=499)
    final = finals[0]
    completion = final.outputs[0]
    answer = _answer(ctx, plan, completion)
    response = finish(shell, output_items(answer, _text_logprobs(ctx, plan, completion, 0)),
                      completion.finish_reason, _usage(ctx, plan, final, completion))
    # A P/D prefill's answer tells the router what to hand the decode instance.
    response = keep(response.model_copy(update={"kv_transfer_params":
                                                final.kv_transfer_params}), answer)
    return JSONResponse(response.model_dump(mode="json"), headers=headers)


async def _plan(ctx: ServerContext, body: ResponsesRequest,
                conversation: list[Message]) -> ChatPlan:
    """The chat plan over the instructions and the conversation. With truncation "auto", a
    conversation too long for the context loses its oldest turns (from a user message on)
    until it fits, the fewest that do. The chat request is validated once (off the event
    loop for a long conversation) and cut, not built again, per try."""
    messages = with_instructions(body.instructions, conversation)
    request = await ctx.prepare(_num_chars(messages), chat_request, body, messages)
    try:
        return await _plan_request(ctx, request)
    except BadRequestError as exc:
        if body.truncation != "auto" or exc.code != "context_length_exceeded":
            raise
        first = len(messages) - len(conversation)  # the instructions stay
        starts = [first + i for i, m in enumerate(conversation) if i > 0 and m["role"] == "user"]
        # Binary search for the earliest turn the rest fits from.
        low, high, best = 0, len(starts) - 1, None
        while low <= high:
            middle = (low + high) // 2
            kept = request.messages[:first] + request.messages[starts[middle]:]
            try:
                best = await _plan_request(ctx, request.model_copy(update={"messages": kept}))
                high = middle - 1
            except BadRequestError as retry:
                if retry.code != "context_length_exceeded":
                    raise
                low = middle + 1
        if best is None:
            raise
        return best


def _num_chars(messages: list[Message]) -> int:
    """What building the chat request costs, in characters of text: a message's fields count
    as much as a short text beside its content."""
    return sum(len(m.get("content") or "") + PER_MESSAGE_CHARS for m in messages)


async def _plan_request(ctx: ServerContext, request: ChatCompletionRequest) -> ChatPlan:
    try:
        return await plan_chat(ctx, request, "input", "max_output_tokens")
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


def _text_logprobs(ctx: ServerContext, plan: ChatPlan, completion: CompletionOutput,
                   start: int) -> list[ChatTokenLogProb] | None:
    """The logprobs of the output text's tokens from token `start` on: not the thinking's."""
    if completion.logprobs is None:
        return None
    start = max(start, num_reasoning_tokens(ctx, completion.token_ids, plan.closed))
    return chat_logprobs(ctx.tokenizer, completion.token_ids[start:],
                         completion.logprobs[start:], plan.params.logprobs or 0).content


def _usage(ctx: ServerContext, plan: ChatPlan, final: RequestOutput,
           completion: CompletionOutput) -> ResponseUsage:
    return usage(ctx, len(plan.prompt.token_ids), len(completion.token_ids),
                 final.num_cached_tokens,
                 num_reasoning_tokens(ctx, completion.token_ids, plan.closed))


async def _stream(ctx: ServerContext, plan: ChatPlan, outputs: Outputs, shell: ResponseObject,
                  keep: Keeper) -> AsyncIterator[str]:
    events = ResponseEvents(shell)
    steps = _StreamSteps(ctx, plan, events, keep)
    try:
        for line in events.start():
            yield line
        async for output in outputs:
            error = output_error(output)
            for line in events.fail(error) if error is not None else steps.lines(output):
                yield line
            if error is not None:
                return
    except Exception as exc:  # the stream has started: report in-band, then end it
        for line in events.fail(to_api_error(exc)):
            yield line


class _StreamSteps:
    """Each engine output of a streamed response as the events it adds."""

    def __init__(self, ctx: ServerContext, plan: ChatPlan, events: ResponseEvents,
                 keep: Keeper) -> None:
        self.ctx, self.plan, self.events, self.keep = ctx, plan, events, keep
        self.tracker, self.tools = DeltaTracker(), ToolStream(plan.tools)
        self.reasoning = ReasoningStream(ctx.reasoning_parser, plan.closed)
        # Output tokens whose logprobs went out (or were the thinking's).
        self.num_logprobs_sent = 0

    def lines(self, output: RequestOutput) -> list[str]:
        completion = output.outputs[0]
        delta = self.tracker.advance(0, completion)
        if delta is None:
            return []
        done = delta.finish_reason is not None
        thought, answer = self.reasoning.step(0, completion.text, done)
        content, calls, _ = self.tools.step(0, answer, delta.finish_reason)
        events = self.events
        lines = events.reasoning(thought) if thought else []
        # Logprobs go with the message's text (none without a message; an answer of nothing
        # else is one message), the last tokens' with the last text.
        if content or done and not calls and (events.writing_text or not events.items):
            logprobs = _text_logprobs(self.ctx, self.plan, completion, self.num_logprobs_sent)
            self.num_logprobs_sent = len(completion.token_ids)
            lines += events.text(content, logprobs or [])
        if calls:
            lines += events.calls(calls)
        if done:
            lines += events.close(completion.finish_reason == "length")
            response = finish(events.response, events.items, completion.finish_reason,
                              _usage(self.ctx, self.plan, output, completion))
            # Kept before the client has the last event, which says whether it was.
            response = self.keep(response, _answer(self.ctx, self.plan, completion))
            lines += events.finish(response)
        return lines
