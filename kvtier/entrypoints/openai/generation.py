"""Opening engine requests for an endpoint, and following them until they end.

`open_generations` adds every prompt's request before the endpoint answers, so refusals (bad
input, full queue) become 400 / 503 instead of a broken 200 stream. Leaving a generator early
(client gone) aborts its request in the engine, and so does a client leaving while its
requests still wait for their first output (`open_or_none`).
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from kvtier.engine.async_llm import EngineDeadError, EngineShuttingDownError, EngineStepError
from kvtier.engine.errors import EngineQueueFullError
from kvtier.engine.outputs import RequestOutput
from kvtier.entrypoints.openai.connection import cancel_on_disconnect
from kvtier.entrypoints.openai.context import ServerContext
from kvtier.entrypoints.openai.errors import (
    APIError,
    BadRequestError,
    InternalServerError,
    NotFoundError,
    ServiceUnavailableError,
)
from kvtier.entrypoints.openai.prompts import Prompt
from kvtier.entrypoints.openai.protocol import SamplingFields
from kvtier.entrypoints.openai.structured import grammar_error
from kvtier.lora import LoRAError, LoRANotLoadedError
from kvtier.sampling_params import SamplingParams
from kvtier.sched.errors import SchedulerQueueFullError
from kvtier.structured_output import GrammarError

Outputs = AsyncIterator[RequestOutput]
# A field named in the engine's ValueErrors: SamplingParams.<name>, or an option of
# add_request at the start ("priority 3 needs the priority scheduling policy ...").
_FIELD_IN_ENGINE_ERROR = re.compile(r"SamplingParams\.(\w+)|^(priority) ")


def to_api_error(exc: BaseException,
                 constraint_param: str = "structured_outputs") -> APIError:
    """The client-facing form of whatever adding or running a request raised;
    `constraint_param`: the request field its structured output constraint came from."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, GrammarError):
        return grammar_error(exc, constraint_param)
    if isinstance(exc, (SchedulerQueueFullError, EngineQueueFullError)):
        return ServiceUnavailableError(f"the server is at capacity ({exc}); retry later",
                                       code="queue_full")
    if isinstance(exc, EngineShuttingDownError):
        return ServiceUnavailableError(str(exc), code="shutting_down")
    if isinstance(exc, EngineDeadError):
        return ServiceUnavailableError(str(exc), code="engine_dead")
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return ServiceUnavailableError("the engine did not answer in time; retry later",
                                       code="timeout")
    if isinstance(exc, EngineStepError):
        return InternalServerError(str(exc), code="engine_step_failed")
    if isinstance(exc, LoRANotLoadedError):
        # A request's adapter was unloaded after its model name was checked.
        return NotFoundError(str(exc), param="model", code="model_not_found")
    if isinstance(exc, LoRAError):  # the adapter its model names cannot be loaded
        return BadRequestError(str(exc), param="model", code="invalid_value")
    if isinstance(exc, ValueError):
        # The engine's checks name the SamplingParams field, as the request names it, or
        # lead with the request option they refuse.
        field = _FIELD_IN_ENGINE_ERROR.search(str(exc))
        param = None if field is None else field.group(1) or field.group(2)
        return BadRequestError(str(exc), param=param, code="invalid_value")
    return InternalServerError(f"internal server error: {exc!r}")


def output_error(output: RequestOutput) -> APIError | None:
    """A request the engine finished with an error (e.g. a failed KV load under policy fail)."""
    if output.error is None:
        return None
    return InternalServerError(f"request failed in the engine: {output.error}",
                               code="request_failed")


def engine_options(ctx: ServerContext, body: SamplingFields) -> dict[str, Any]:
    """The request fields that go to the engine beside the prompt and SamplingParams."""
    return {"priority": body.priority, "cache_salt": body.cache_salt,
            "kv_transfer_params": body.kv_transfer_params,
            "lora_request": ctx.lora_request(body.model)}


async def open_or_none(raw: Request, ctx: ServerContext, prompts: list[Prompt],
                       params: SamplingParams, request_ids: list[str],
                       options: dict[str, Any], *,
                       constraint_param: str = "structured_outputs") -> list[Outputs] | None:
    """open_generations, or None (its requests aborted) if the client leaves first: a request
    queued behind others must not outlive its client."""
    return await cancel_on_disconnect(
        raw, open_generations(ctx, prompts, params, request_ids, options,
                              constraint_param=constraint_param))


def engine_request_id(request_id: str) -> str:
    """The engine's id for a client's request: a server-chosen suffix keeps two clients that
    send the same X-Request-Id apart, and tells neither that the other's is live."""
    return f"{request_id}-{uuid.uuid4().hex[:8]}"


async def open_generations(ctx: ServerContext, prompts: list[Prompt], params: SamplingParams,
                           request_ids: list[str], options: dict[str, Any], *,
                           constraint_param: str = "structured_outputs") -> list[Outputs]:
    """One started generation per prompt (request_ids: the ids responses carry); if any is
    refused, the others are aborted. `constraint_param`: the request field a structured
    output constraint that does not compile is named by in the 400."""
    results = await asyncio.gather(
        *(_open_one(ctx, p, params, rid, options) for p, rid in zip(prompts, request_ids)),
        return_exceptions=True)
    failure = next((r for r in results if isinstance(r, BaseException)), None)
    if failure is None:
        return list(results)
    lora = options.get("lora_request")
    if isinstance(failure, LoRAError) and lora is not None:
        # Its directory no longer loads (deleted, broken): no longer listed as a model.
        ctx.lora_modules.pop(lora.lora_name, None)
    for result in results:
        if not isinstance(result, BaseException):
            await result.aclose()
    raise to_api_error(failure, constraint_param) from failure


async def _open_one(ctx: ServerContext, prompt: Prompt, params: SamplingParams,
                    request_id: str, options: dict[str, Any]) -> Outputs:
    outputs = ctx.async_llm.generate(prompt.token_ids, params, engine_request_id(request_id),
                                     **options)
    try:
        first = await outputs.__anext__()
    except BaseException:
        await outputs.aclose()
        raise
    return _prepend(first, outputs)


async def _prepend(first: RequestOutput, rest: Outputs) -> Outputs:
    try:
        yield first
        if not first.finished:
            async for output in rest:
                yield output
    finally:
        await rest.aclose()


async def finals_or_none(raw: Request, generations: list[Outputs]) -> list[RequestOutput] | None:
    """Each generation's finished output; None if the client left first (its requests are
    aborted). Raises the first error the engine finished a request with."""
    finals = await cancel_on_disconnect(raw, final_outputs(generations))
    for final in finals or ():
        error = output_error(final)
        if error is not None:
            raise error
    return finals


async def final_outputs(generations: list[Outputs]) -> list[RequestOutput]:
    """The last (finished) output of each generation, run concurrently."""
    async def last(outputs: Outputs) -> RequestOutput:
        final = None
        try:
            async for final in outputs:  # noqa: B007 (keeps the last one)
                pass
        finally:
            await outputs.aclose()
        return final

    tasks = [asyncio.ensure_future(last(g)) for g in generations]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


async def merged(generations: list[Outputs]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from all generations in arrival order."""
    if len(generations) == 1:
        async for output in generations[0]:
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, outputs: Outputs) -> None:
        try:
            async for output in outputs:
                queue.put_nowait((index, output))
            queue.put_nowait((index, None))
        except Exception as exc:  # handed to the consumer, which re-raises it
            queue.put_nowait((index, exc))
        finally:
            await outputs.aclose()

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(generations)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
