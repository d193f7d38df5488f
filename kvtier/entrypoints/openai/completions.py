"""POST /v1/completions: one engine request per prompt, n choices each."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvtier.engine.outputs import RequestOutput
from kvtier.entrypoints.openai.connection import REQUEST_ID_HEADER, base_request_id
from kvtier.entrypoints.openai.context import ServerContext
from kvtier.entrypoints.openai.generation import (
    Outputs,
    engine_options,
    finals_or_none,
    merged,
    open_or_none,
    output_error,
    to_api_error,
)
from kvtier.entrypoints.openai.logprobs import completion_logprobs, prompt_logprobs_body
from kvtier.entrypoints.openai.prompts import (
    Prompt,
    check_context,
    check_text,
    completion_prompts,
    prompt_chars,
    truncate,
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
    DeltaTracker,
    sse,
    sse_error,
    sse_response,
    usage_info,
)
from kvtier.entrypoints.openai.structured import check_min_tokens, constraint_field

router = APIRouter()


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, raw: Request) -> Response:
    ctx: ServerContext = raw.app.state.ctx
    check_text(body)  # first: an error message quoting a bad string could not be sent
    ctx.check_model(body.model)
    check_token_ids(body, ctx.vocab_size)
    prompts = await ctx.prepare(prompt_chars(body.prompt), completion_prompts, ctx, body.prompt,
                                body.add_special_tokens)
    params = completion_sampling_params(body, len(prompts), ctx.sampling_defaults)
    check_min_tokens(params)
    prompts = [truncate(ctx, prompt, body, params.max_tokens) for prompt in prompts]
    if body.echo:  # each choice (and chunk) shows the prompt's text: decode token ids once
        prompts = [_with_text(ctx, prompt) for prompt in prompts]
    for i, prompt in enumerate(prompts):
        check_context(ctx, prompt, params.max_tokens,
                      "prompt" if len(prompts) == 1 else f"prompt[{i}]", "max_tokens")
    ctx.metrics.observe_params(params.n, params.max_tokens)
    request_id = base_request_id(raw)
    response_id = f"cmpl-{request_id}"
    request_ids = [response_id] if len(prompts) == 1 else \
        [f"{response_id}-{i}" for i in range(len(prompts))]
    generations = await open_or_none(raw, ctx, prompts, params, request_ids,
                                     engine_options(ctx, body),
                                     constraint_param=constraint_field(body))
    if generations is None:
        return Response(status_code=499)
    headers = {REQUEST_ID_HEADER: request_id}  # echoed as the client sent it
    if body.stream:
        return sse_response(_stream(ctx, body, prompts, generations, response_id), headers)
    finals = await finals_or_none(raw, generations)
    if finals is None:
        return Response(status_code=499)
    response = _response(ctx, body, prompts, finals, response_id)
    return JSONResponse(response.model_dump(), headers=headers)


def _prompt_only(body: CompletionRequest) -> bool:
    """echo with max_tokens 0: each choice is its prompt, nothing generated (the engine's one
    token past it is dropped)."""
    return body.echo and body.max_tokens == 0


def _choice(ctx: ServerContext, body: CompletionRequest, prompt: Prompt, index: int,
            final: RequestOutput, text: str, token_ids: list[int], logprobs: list | None,
            text_offset: int, finish_reason: str | None, stop_reason: int | str | None, *,
            first: bool) -> CompletionChoice:
    """A choice of a response, or its part in one chunk of a stream: the text, tokens and
    logprobs new in it; `text_offset`: the logprobs' offset of its first token (the lengths of
    the tokens' texts before it, see _next_offset); `first`: the part that opens the choice,
    where an echoed prompt goes."""
    if _prompt_only(body):
        text, token_ids, logprobs = "", [], []
        if finish_reason is not None:
            finish_reason, stop_reason = "length", None
    shown_ids, shown_logprobs = token_ids, logprobs
    if body.echo and first:
        text = prompt.text + text
        shown_ids = prompt.token_ids + token_ids
        if logprobs is not None:
            # As vLLM has it: the echoed prompt's tokens get their logprobs too.
            shown_logprobs = [*(final.prompt_logprobs or [None] * len(prompt.token_ids)),
                              *logprobs]
    api_logprobs = None
    if body.logprobs is not None and shown_logprobs is not None:
        api_logprobs = completion_logprobs(ctx.tokenizer, shown_ids, shown_logprobs,
                                           body.logprobs, text_offset,
                                           body.return_tokens_as_token_ids)
    return CompletionChoice(
        index=index, text=text, logprobs=api_logprobs, finish_reason=finish_reason,
        stop_reason=stop_reason,
        prompt_logprobs=prompt_logprobs_body(final.prompt_logprobs)
        if body.prompt_logprobs is not None and first else None,
        prompt_token_ids=prompt.token_ids if body.return_token_ids and first else None,
        token_ids=token_ids if body.return_token_ids else None)


def _with_text(ctx: ServerContext, prompt: Prompt) -> Prompt:
    """`prompt` with its text: token ids decoded when it came as ids."""
    if prompt.text is not None:
        return prompt
    text = ctx.tokenizer.decode(prompt.token_ids) if ctx.tokenizer is not None else ""
    return Prompt(text, prompt.token_ids)


def _response(ctx: ServerContext, body: CompletionRequest, prompts: list[Prompt],
              finals: list[RequestOutput], response_id: str) -> CompletionResponse:
    choices = [_choice(ctx, body, prompt, prompt_index * body.n + completion.index, final,
                       completion.text, completion.token_ids, completion.logprobs, 0,
                       completion.finish_reason, completion.stop_reason, first=True)
               for prompt_index, (prompt, final) in enumerate(zip(prompts, finals))
               for completion in final.outputs]
    num_completion = 0 if _prompt_only(body) else \
        sum(len(c.token_ids) for f in finals for c in f.outputs)
    usage = usage_info(ctx, sum(len(p.token_ids) for p in prompts), num_completion,
                       sum(f.num_cached_tokens for f in finals))
    return CompletionResponse(id=response_id, model=ctx.response_model(body.model),
                              choices=choices, usage=usage,
                              kv_transfer_params=finals[0].kv_transfer_params)


async def _stream(ctx: ServerContext, body: CompletionRequest, prompts: list[Prompt],
                  generations: list[Outputs], response_id: str) -> AsyncIterator[str]:
    trackers = [DeltaTracker() for _ in prompts]
    offsets: dict[int, int] = {}  # choice index -> logprobs' text offset of its next token
    num_cached = [0] * len(prompts)
    num_prompt = sum(len(p.token_ids) for p in prompts)
    options = body.stream_options
    model = ctx.response_model(body.model)

    def usage() -> UsageInfo:
        num_completion = 0 if _prompt_only(body) else \
            sum(t.num_completion_tokens for t in trackers)
        return usage_info(ctx, num_prompt, num_completion, sum(num_cached))

    try:
        async for prompt_index, output in merged(generations):
            error = output_error(output)
            if error is not None:
                yield sse_error(error)
                break
            num_cached[prompt_index] = output.num_cached_tokens
            choices = _chunk_choices(ctx, body, prompts[prompt_index], prompt_index,
                                     trackers[prompt_index], offsets, output)
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
                   prompt_index: int, tracker: DeltaTracker, offsets: dict[int, int],
                   output: RequestOutput) -> list[CompletionChoice]:
    """`offsets`: each choice's logprobs text offset for its next token, advanced here."""
    choices = []
    for completion in output.outputs:
        delta = tracker.advance(completion.index, completion)
        if delta is None:
            continue
        index = prompt_index * body.n + completion.index
        choice = _choice(ctx, body, prompt, index, output, delta.text, delta.token_ids,
                         delta.logprobs, offsets.get(index, 0), delta.finish_reason,
                         delta.stop_reason, first=delta.is_first)
        offsets[index] = _next_offset(choice, offsets.get(index, 0))
        choices.append(choice)
    return choices


def _next_offset(choice: CompletionChoice, offset: int) -> int:
    """The text offset of the token after `choice`'s logprobs. It counts the tokens' own
    texts, as a whole response's offsets do, not the text sent: a stream holds text back (a
    stop string's beginning, a character's first bytes) that its tokens already carry."""
    logprobs = choice.logprobs
    if logprobs is None or not logprobs.tokens:
        return offset
    return logprobs.text_offset[-1] + len(logprobs.tokens[-1])
