"""POST /v1/chat/completions: the chat template renders the messages into one prompt."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvtier.engine.outputs import RequestOutput
from kvtier.entrypoints.openai.connection import REQUEST_ID_HEADER, base_request_id
from kvtier.entrypoints.openai.context import ServerContext
from kvtier.entrypoints.openai.generation import (
    Outputs,
    engine_options,
    finals_or_none,
    open_or_none,
    output_error,
    to_api_error,
)
from kvtier.entrypoints.openai.logprobs import chat_logprobs, prompt_logprobs_body
from kvtier.entrypoints.openai.prompts import (
    Prompt,
    chat_prompt,
    check_context,
    check_text,
    message_chars,
    truncate,
)
from kvtier.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    UsageInfo,
)
from kvtier.entrypoints.openai.reasoning import (
    ReasoningStream,
    split_reasoning,
    thinking_closed,
)
from kvtier.entrypoints.openai.sampling import chat_sampling_params, check_token_ids
from kvtier.entrypoints.openai.streaming import (
    DONE,
    DeltaTracker,
    sse,
    sse_error,
    sse_response,
    usage_info,
)
from kvtier.entrypoints.openai.structured import check_min_tokens, constraint_field
from kvtier.entrypoints.openai.tools import (
    ParsedAnswer,
    ToolChoice,
    ToolStream,
    finish_reason,
    parse_answer,
    tool_choice,
    tool_constraint,
)
from kvtier.sampling_params import SamplingParams

router = APIRouter()


@dataclass(frozen=True)
class ChatPlan:
    """A chat request made ready for the engine: its prompt, sampling, tools and options."""

    prompt: Prompt
    params: SamplingParams
    tools: ToolChoice
    # With a reasoning parser: whether the prompt already ended the thinking.
    closed: bool
    options: dict[str, Any]
    # The request field its structured output constraint came from, for the 400 if the engine
    # cannot compile it (see open_or_none).
    constraint_param: str


async def plan_chat(ctx: ServerContext, body: ChatCompletionRequest,
                    prompt_param: str = "messages",
                    max_tokens_param: str | None = None) -> ChatPlan:
    """Checks, renders and tokenizes a chat request (400s name `prompt_param` for the
    messages and `max_tokens_param` for the token limit, as the endpoint calls them)."""
    check_text(body)  # first: an error message quoting a bad string could not be sent
    ctx.check_model(body.model)
    check_token_ids(body, ctx.vocab_size)
    tools = tool_choice(body, ctx.tool_call_parser)
    calls_constraint = tool_constraint(body, tools)
    params = chat_sampling_params(body, ctx.sampling_defaults, calls_constraint)
    given_in = "tools" if calls_constraint is not None else constraint_field(body)
    prompt = await ctx.prepare(message_chars(body.messages, body.tools), chat_prompt, ctx, body)
    prompt = truncate(ctx, prompt, body, params.max_tokens)
    if max_tokens_param is None:
        max_tokens_param = "max_completion_tokens" if body.max_completion_tokens is not None \
            else "max_tokens"
    check_context(ctx, prompt, params.max_tokens, prompt_param, max_tokens_param)
    closed = ctx.thinking_token_ids is not None and thinking_closed(prompt.token_ids,
                                                                    *ctx.thinking_token_ids)
    if ctx.thinking_token_ids is None or closed:  # else the thinking counts to min_tokens
        check_min_tokens(params)
    options = {**engine_options(ctx, body),
               **await _answer_grammar(ctx, params, closed, given_in)}
    return ChatPlan(prompt, params, tools, closed, options, given_in)


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
    ctx: ServerContext = raw.app.state.ctx
    plan = await plan_chat(ctx, body)
    ctx.metrics.observe_params(plan.params.n, plan.params.max_tokens)
    request_id = base_request_id(raw)
    response_id = f"chatcmpl-{request_id}"
    generations = await open_or_none(raw, ctx, [plan.prompt], plan.params, [response_id],
                                     plan.options, constraint_param=plan.constraint_param)
    if generations is None:
        return Response(status_code=499)
    headers = {REQUEST_ID_HEADER: request_id}  # echoed as the client sent it
    if body.stream:
        return sse_response(_stream(ctx, body, plan.prompt, generations[0], response_id,
                                    ToolStream(plan.tools),
                                    ReasoningStream(ctx.reasoning_parser, plan.closed)),
                            headers)
    finals = await finals_or_none(raw, generations)
    if finals is None:
        return Response(status_code=499)
    response = _response(ctx, body, plan.prompt, finals[0], response_id, plan.tools,
                         plan.closed)
    return JSONResponse(response.model_dump(), headers=headers)


async def _answer_grammar(ctx: ServerContext, params: SamplingParams, closed: bool,
                          constraint_param: str) -> dict[str, Any]:
    """With a reasoning parser, a structured output constraint holds the answer only: its
    grammar, compiled here, starts after the thinking ends (engine option `grammar`)."""
    if params.structured_outputs is None or ctx.thinking_token_ids is None or closed:
        return {}
    try:
        grammar = await ctx.async_llm.compile_grammar(params)
    except Exception as exc:  # a bad constraint (400), a dead or busy engine (503)
        raise to_api_error(exc, constraint_param) from exc
    grammar.starts_after = ctx.thinking_token_ids[1]
    return {"grammar": grammar}


def _shows_tokens(ctx: ServerContext, body: ChatCompletionRequest) -> bool:
    """Logprobs and token ids would show thinking that include_reasoning false hides: then
    they are left out, as vLLM leaves them."""
    return body.include_reasoning or ctx.reasoning_parser is None


def _num_top(body: ChatCompletionRequest) -> int:
    return body.top_logprobs or 0


def _response(ctx: ServerContext, body: ChatCompletionRequest, prompt: Prompt,
              final: RequestOutput, response_id: str, tools: ToolChoice,
              closed: bool) -> ChatCompletionResponse:
    choices = []
    shown = _shows_tokens(ctx, body)
    for completion in final.outputs:
        logprobs = None
        if body.logprobs and completion.logprobs is not None and shown:
            logprobs = chat_logprobs(ctx.tokenizer, completion.token_ids, completion.logprobs,
                                     _num_top(body), body.return_tokens_as_token_ids)
        reasoning, content = split_reasoning(ctx.reasoning_parser, completion.text, closed)
        answer = parse_answer(tools, content) if content is not None else ParsedAnswer(None, [])
        choices.append(ChatChoice(
            index=completion.index,
            message=ChatResponseMessage(content=answer.content, tool_calls=answer.tool_calls,
                                        reasoning=reasoning if body.include_reasoning
                                        else None),
            logprobs=logprobs,
            finish_reason=finish_reason(tools, answer, completion.finish_reason),
            stop_reason=completion.stop_reason,
            token_ids=completion.token_ids if body.return_token_ids and shown else None))
    num_completion = sum(len(c.token_ids) for c in final.outputs)
    usage = usage_info(ctx, len(prompt.token_ids), num_completion, final.num_cached_tokens)
    return ChatCompletionResponse(
        id=response_id, model=ctx.response_model(body.model), choices=choices, usage=usage,
        prompt_token_ids=prompt.token_ids if body.return_token_ids else None,
        prompt_logprobs=prompt_logprobs_body(final.prompt_logprobs),
        kv_transfer_params=final.kv_transfer_params)


async def _stream(ctx: ServerContext, body: ChatCompletionRequest, prompt: Prompt,
                  outputs: Outputs, response_id: str, tools: ToolStream,
                  reasoning: ReasoningStream) -> AsyncIterator[str]:
    tracker = DeltaTracker()
    num_cached = 0
    prompt_logprobs_sent = False
    options = body.stream_options
    model = ctx.response_model(body.model)

    def usage() -> UsageInfo:
        return usage_info(ctx, len(prompt.token_ids), tracker.num_completion_tokens,
                          num_cached)

    try:
        async for output in outputs:
            error = output_error(output)
            if error is not None:
                yield sse_error(error)
                break
            num_cached = output.num_cached_tokens
            choices = [choice for completion in output.outputs
                       if (choice := _stream_choice(ctx, body, tracker, completion, tools,
                                                    reasoning))]
            if choices:
                continuous = options is not None and options.continuous_usage_stats
                # The prompt's logprobs go with the first chunk.
                prompt_logprobs = None if prompt_logprobs_sent else \
                    prompt_logprobs_body(output.prompt_logprobs)
                prompt_logprobs_sent = True
                yield sse(ChatCompletionChunk(id=response_id, model=model, choices=choices,
                                              usage=usage() if continuous else None,
                                              prompt_logprobs=prompt_logprobs))
        else:
            if options and options.include_usage:
                yield sse(ChatCompletionChunk(id=response_id, model=model, choices=[],
                                              usage=usage()))
    except Exception as exc:  # the stream has started: report in-band, then end it
        yield sse_error(to_api_error(exc))
    yield DONE


def _stream_choice(ctx: ServerContext, body: ChatCompletionRequest, tracker: DeltaTracker,
                   completion, tools: ToolStream,
                   reasoning: ReasoningStream) -> ChatStreamChoice | None:
    delta = tracker.advance(completion.index, completion)
    if delta is None:
        return None
    # The text is the thinking, then the content; the content sent is what the tool calls
    # leave of it (all of it without a reasoning parser and tools).
    thought, answer = reasoning.step(completion.index, completion.text,
                                     delta.finish_reason is not None)
    content, tool_calls, reason = tools.step(completion.index, answer, delta.finish_reason)
    thought = thought if body.include_reasoning else ""
    shown = _shows_tokens(ctx, body)
    if not (content or tool_calls or thought or reason or delta.is_first
            or shown and (body.logprobs or body.return_token_ids)):
        return None  # nothing to say yet (held back, hidden thinking, or no text)
    message = DeltaMessage(role="assistant" if delta.is_first else None, content=content,
                           tool_calls=tool_calls, reasoning=thought or None)
    logprobs = None
    if body.logprobs and delta.logprobs is not None and shown:
        logprobs = chat_logprobs(ctx.tokenizer, delta.token_ids, delta.logprobs, _num_top(body),
                                 body.return_tokens_as_token_ids)
    return ChatStreamChoice(index=completion.index, delta=message, logprobs=logprobs,
                            finish_reason=reason, stop_reason=delta.stop_reason,
                            token_ids=delta.token_ids if body.return_token_ids and shown
                            else None)
