"""POST /v1/completions: one engine request per prompt, n choices each."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvtier.engine.outputs import CompletionOutput, RequestOutput
from kvtier.entrypoints.openai.connection import REQUEST_ID_HEADER, base_request_id
from kvtier.entrypoints.openai.context import ServerContext
from kvtier.entrypoints.openai.errors import BadRequestError
from kvtier.entrypoints.openai.generation import (
    Outputs,
    engine_options,
    finals_or_none,
    merged,
    open_or_none,
    output_error,
    to_api_error,
)
from kvtier.entrypoints.openai.logprobs import completion_logprobs
from kvtier.entrypoints.openai.prompts import (
    Prompt,
    check_context,
    check_text,
    completion_prompts,
    prompt_chars,
)
from kvtier.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from kvtier.entrypoints.openai.sampling import check_token_ids, completion_sampling_params
from kvtier.entrypoints.openai.streaming import (
    DONE,
    SSE_HEADERS,
    DeltaTracker,
    sse,
    sse_error,
    usage_info,
)

router = APIRouter()


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, raw: Request) -> Response:
    ctx: ServerContext = raw.app.state.ctx
    check_text(body)  # first: an error message quoting a bad string could not be sent
    ctx.check_model(body.model)
    check_token_ids(body, ctx.vocab_size)
    prompts = await ctx.prepare(prompt_chars(body.prompt), completion_prompts, ctx, body.prompt)
    params = completion_sampling_params(body, len(prompts), ctx.sampling_defaults)
    if body.echo and body.logprobs is not None:
        raise BadRequestError("echo together with logprobs is not supported", param="echo",
                              code="unsupported_parameter")
    for i, prompt in enumerate(prompts):
        check_context(ctx, prompt, params.max_tokens,
                      "prompt" if len(prompts) == 1 else f"prompt[{i}]", "max_tokens")
    ctx.metrics.observe_params(params.n, params.max_tokens)
    request_id = base_request_id(raw)
    response_id = f"cmpl-{request_id}"
    request_ids = [response_id] if len(prompts) == 1 else \
        [f"{response_id}-{i}" for i in range(len(prompts))]
    generations = await open_or_none(raw, ctx, prompts, params, request_ids,
                                     engine_options(body))
    if generations is None:
        return Response(status_code=499)
    headers = {REQUEST_ID_HEADER: request_id}  # echoed as the client sent it
    if body.stream:
        return StreamingResponse(_stream(ctx, body, prompts, generations, response_id),
                                 media_type="text/event-stream",
                                 headers={**SSE_HEADERS, **headers})
    finals = await finals_or_none(raw, generations)
    if finals is None:
        return Response(status_code=499)
    response = _response(ctx, body, prompts, finals, response_id)
    return JSONResponse(response.model_dump(), headers=headers)


def _choice_text(body: CompletionRequest, prompt_text: str, completion: CompletionOutput) -> str:
    return prompt_text + completion.text if body.echo else completion.text


def _prompt_text(ctx: ServerContext, prompt: Prompt) -> str:
    if prompt.text is not None:
        return prompt.text
    return ctx.tokenizer.decode(prompt.token_ids) if ctx.tokenizer is not None else ""


def _response(ctx: ServerContext, body: CompletionRequest, prompts: list[Prompt],
              finals: list[RequestOutput], response_id: str) -> CompletionResponse:
    choices = []
    for prompt_index, (prompt, final) in enumerate(zip(prompts, finals)):
        prompt_text = _prompt_text(ctx, prompt) if body.echo else ""
        for completion in final.outputs:
            logprobs = None
            if body.logprobs is not None and completion.logprobs is not None:
                logprobs = completion_logprobs(ctx.tokenizer, completion.token_ids,
                                               completion.logprobs, body.logprobs, 0)
            choices.append(CompletionChoice(
                index=prompt_index * body.n + completion.index,
                text=_choice_text(body, prompt_text, completion), logprobs=logprobs,
                finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                prompt_token_ids=prompt.token_ids if body.return_token_ids else None,
                token_ids=completion.token_ids if body.return_token_ids else None))
    num_completion = sum(len(c.token_ids) for f in finals for c in f.outputs)
    usage = usage_info(ctx, sum(len(p.token_ids) for p in prompts), num_completion,
                       sum(f.num_cached_tokens for f in finals))
    return CompletionResponse(id=response_id, model=ctx.response_model(body.model),
                              choices=choices, usage=usage,
                              kv_transfer_params=finals[0].kv_transfer_params)


async def _stream(ctx: ServerContext, body: CompletionRequest, prompts: list[Prompt],
                  generations: list[Outputs], response_id: str) -> AsyncIterator[str]:
    trackers = [DeltaTracker() for _ in prompts]
    num_cached = [0] * len(prompts)
    num_prompt = sum(len(p.token_ids) for p in prompts)
    options = body.stream_options
    model = ctx.response_model(body.model)

    def usage() -> UsageInfo:
        return usage_info(ctx, num_prompt, sum(t.num_completion_tokens for t in trackers),
                          sum(num_cached))

    try:
        async for prompt_index, output in merged(generations):
            error = output_error(output)
            if error is not None:
                yield sse_error(error)
                break
            num_cached[prompt_index] = output.num_cached_tokens
            choices = _chunk_choices(ctx, body, prompts[prompt_index], prompt_index,
                                     trackers[prompt_index], output)
            if choices:
                continuous = options is not None and options.continuous_usage_stats
                yield sse(CompletionChunk(id=response_id, model=model, choices=choices,
                                          usage=usage() if continuous else None))
        else:
            if options and options.include_usage:
                yield sse(CompletionChunk(id=response_id, model=model, choices=[],
                                          usage=usage()))
    except Exception as exc:  # the stream has started: report in-band, then end it
        yield sse_error(to_api_error(exc))
    yield DONE


def _chunk_choices(ctx: ServerContext, body: CompletionRequest, prompt: Prompt,
                   prompt_index: int, tracker: DeltaTracker,
                   output: RequestOutput) -> list[CompletionChoice]:
    choices = []
    for completion in output.outputs:
        delta = tracker.advance(completion.index, completion)
        if delta is None:
            continue
        prefix = _prompt_text(ctx, prompt) if body.echo and delta.is_first else ""
        logprobs = None
        if body.logprobs is not None and delta.logprobs is not None:
            logprobs = completion_logprobs(ctx.tokenizer, delta.token_ids, delta.logprobs,
                                           body.logprobs, delta.text_start)
        choices.append(CompletionChoice(
            index=prompt_index * body.n + completion.index, text=prefix + delta.text,
            logprobs=logprobs, finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason,
            prompt_token_ids=prompt.token_ids if body.return_token_ids and delta.is_first
            else None,
            token_ids=delta.token_ids if body.return_token_ids else None))
    return choices
