"""POST /v1/messages and POST /v1/messages/count_tokens."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvtier.engine.outputs import CompletionOutput
from kvtier.entrypoints.anthropic.convert import (
    Answer,
    answer,
    chat_request,
    messages_param,
    usage,
)
from kvtier.entrypoints.anthropic.protocol import (
    CountTokensRequest,
    MessageObject,
    MessagesRequest,
)
from kvtier.entrypoints.anthropic.stream import stream_events
from kvtier.entrypoints.openai.chat import ChatPlan, plan_chat
from kvtier.entrypoints.openai.connection import REQUEST_ID_HEADER, base_request_id
from kvtier.entrypoints.openai.context import ServerContext
from kvtier.entrypoints.openai.errors import APIError
from kvtier.entrypoints.openai.generation import finals_or_none, open_or_none
from kvtier.entrypoints.openai.prompts import (
    PER_MESSAGE_CHARS,
    chat_prompt,
    check_text,
    json_chars,
    message_chars,
)
from kvtier.entrypoints.openai.protocol import ChatCompletionRequest
from kvtier.entrypoints.openai.reasoning import split_reasoning
from kvtier.entrypoints.openai.streaming import sse_response
from kvtier.entrypoints.openai.tools import ParsedAnswer, parse_answer

router = APIRouter()


@router.post("/v1/messages")
async def create_message(body: MessagesRequest, raw: Request) -> Response:
    ctx: ServerContext = raw.app.state.ctx
    plan = await _plan(ctx, body)
    ctx.metrics.observe_params(plan.params.n, plan.params.max_tokens)
    shell = MessageObject(model=ctx.response_model(body.model),
                          usage=usage(ctx, len(plan.prompt.token_ids), 0, 0))
    try:
        generations = await open_or_none(raw, ctx, [plan.prompt], plan.params, [shell.id],
                                         plan.options, constraint_param=plan.constraint_param)
    except APIError as exc:  # a constraint that does not compile names a chat field
        exc.param = messages_param(exc.param)
        raise
    if generations is None:
        return Response(status_code=499)
    headers = {REQUEST_ID_HEADER: base_request_id(raw)}
    if body.stream:
        return sse_response(stream_events(ctx, plan, generations[0], shell), headers)
    finals = await finals_or_none(raw, generations)
    if finals is None:
        return Response(status_code=499)
    final = finals[0]
    completion = final.outputs[0]
    told = message_answer(ctx, plan, completion)
    message = shell.model_copy(update={
        "content": told.content, "stop_reason": told.stop_reason,
        "stop_sequence": told.stop_sequence,
        "usage": usage(ctx, len(plan.prompt.token_ids), len(completion.token_ids),
                       final.num_cached_tokens),
        # A P/D prefill's answer tells the router what to hand the decode instance.
        "kv_transfer_params": final.kv_transfer_params})
    return JSONResponse(message.model_dump(mode="json"), headers=headers)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, raw: Request) -> JSONResponse:
    """The prompt's tokens, as /v1/messages would compute them."""
    ctx: ServerContext = raw.app.state.ctx
    request = await _chat_request(ctx, body)
    ctx.check_model(request.model)
    try:
        prompt = await ctx.prepare(message_chars(request.messages, request.tools), chat_prompt,
                                   ctx, request)
    except APIError as exc:
        exc.param = messages_param(exc.param)
        raise
    return JSONResponse({"input_tokens": len(prompt.token_ids)})


async def _chat_request(ctx: ServerContext, body: CountTokensRequest) -> ChatCompletionRequest:
    check_text(body)  # first: an error message quoting a bad string could not be sent
    # Converting walks the blocks as rendering walks the messages: off the loop when long.
    num_chars = json_chars([body.system, body.messages, body.tools]) \
        + PER_MESSAGE_CHARS * len(body.messages)
    return await ctx.prepare(num_chars, chat_request, body)


async def _plan(ctx: ServerContext, body: MessagesRequest) -> ChatPlan:
    request = await _chat_request(ctx, body)
    try:
        return await plan_chat(ctx, request, "messages", "max_tokens")
    except APIError as exc:  # the chat path names chat fields
        exc.param = messages_param(exc.param)
        raise


def message_answer(ctx: ServerContext, plan: ChatPlan, completion: CompletionOutput) -> Answer:
    """A whole output as content blocks and its stop reason."""
    reasoning, text = split_reasoning(ctx.reasoning_parser, completion.text, plan.closed)
    parsed = parse_answer(plan.tools, text) if text is not None else ParsedAnswer(None, [])
    return answer(reasoning, text, parsed, completion.finish_reason, completion.stop_reason)
