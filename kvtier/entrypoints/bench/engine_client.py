"""The in-process target: the server's request path without HTTP, on an AsyncLLM in this process.

Each turn's body is the one the HTTP client sends (client.request_body). The server's own code
turns it into a prompt and SamplingParams (request model, chat template, tokenization, context
check), and the request streams from an AsyncLLM whose one engine thread batches every
conversation, as under `kvtier serve`. A run here and one against `kvtier serve` with the same
engine options therefore differ only by the HTTP hop. Hit rates come from the engine's metrics
registry, parsed as a scrape of the server's /metrics would be.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any

from kvtier.engine.async_llm import (
    AsyncLLM,
    EngineDeadError,
    EngineShuttingDownError,
    EngineStepError,
)
from kvtier.engine.engine import Engine
from kvtier.engine.errors import EngineQueueFullError
from kvtier.engine.outputs import RequestOutput
from kvtier.entrypoints.bench.client import RequestResult, request_body
from kvtier.entrypoints.bench.config import EngineTarget
from kvtier.entrypoints.bench.metrics_scrape import Samples, registry_samples
from kvtier.entrypoints.bench.workload import ConversationId
from kvtier.entrypoints.openai.context import ServerContext, ServerMetrics
from kvtier.entrypoints.openai.errors import APIError
from kvtier.entrypoints.openai.generation import engine_options, open_generations, output_error
from kvtier.entrypoints.openai.prompts import Prompt, chat_prompt, check_context, completion_prompts
from kvtier.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from kvtier.entrypoints.openai.sampling import chat_sampling_params, completion_sampling_params
from kvtier.sampling_params import SamplingParams

# What fails one turn, as an HTTP error status would against the server; the run goes on.
_TURN_ERRORS = (APIError, ValueError, EngineDeadError, EngineShuttingDownError, EngineStepError,
                EngineQueueFullError)
# Seconds in-flight requests get at the end of a run; only a run cut off by its deadline has any.
_DRAIN_TIMEOUT_S = 5.0


@dataclass
class _Progress:
    """What has arrived so far for one request."""

    first_token_at: float | None = None
    last: RequestOutput | None = None

    def observe(self, output: RequestOutput) -> None:
        if self.first_token_at is None and output.outputs and output.outputs[0].token_ids:
            self.first_token_at = time.perf_counter()
        self.last = output


@dataclass(frozen=True)
class _PreparedTurn:
    prompt: Prompt
    params: SamplingParams
    options: dict[str, Any]  # engine options beside prompt and params (priority, cache_salt...)


class InProcessClient:
    """Sends one turn of a conversation to the in-process engine and times it."""

    def __init__(self, ctx: ServerContext, target: EngineTarget, output_tokens: int,
                 clock_origin: float) -> None:
        self._ctx = ctx
        self._target = target
        self._output_tokens = output_tokens
        self._origin = clock_origin

    async def send(self, conversation_id: ConversationId, turn: int,
                   messages: list[dict[str, str]]) -> RequestResult:
        """Stream one turn; errors are recorded in the result, not raised."""
        path, body = request_body(self._target.api, self._ctx.model_name, messages,
                                  self._output_tokens)
        return await self.send_body(conversation_id, turn, path, body)

    async def send_body(self, conversation_id: ConversationId, turn: int, path: str,
                        body: dict[str, Any]) -> RequestResult:
        """Stream one request as the server's endpoint at `path` would take `body`; errors are
        recorded in the result, not raised."""
        started = time.perf_counter()
        progress = _Progress()
        num_prompt_tokens = None
        error = None
        try:
            async with asyncio.timeout(self._target.request_timeout_s):
                prepared = self._prepare(path, body)
                num_prompt_tokens = len(prepared.prompt.token_ids)
                await self._stream_into(f"bench-{conversation_id}-{turn}", prepared, progress)
        except TimeoutError:
            error = f"TimeoutError: no complete reply in {self._target.request_timeout_s} s"
        except _TURN_ERRORS as exc:
            error = f"{type(exc).__name__}: {exc}"
        finished = time.perf_counter()
        final = progress.last.outputs[0] if progress.last and progress.last.outputs else None
        return RequestResult(
            conversation_id=conversation_id,
            turn=turn,
            start_s=started - self._origin,
            ttft_s=None if progress.first_token_at is None else progress.first_token_at - started,
            latency_s=finished - started,
            output_text=final.text if final else "",
            num_prompt_tokens=num_prompt_tokens,
            num_output_tokens=len(final.token_ids) if final else 0,
            error=error,
        )

    def _prepare(self, path: str, body: dict[str, Any]) -> _PreparedTurn:
        """What the server's endpoint at `path` makes of this body, with its refusals."""
        ctx = self._ctx
        if path == "/v1/chat/completions":
            chat = ChatCompletionRequest.model_validate(body)
            params = chat_sampling_params(chat)
            prompt = chat_prompt(ctx, chat)
            check_context(ctx, prompt, params.max_tokens, "messages", "max_tokens")
            options = engine_options(ctx, chat)
        else:
            completion = CompletionRequest.model_validate(body)
            (prompt,) = completion_prompts(ctx, completion.prompt)
            params = completion_sampling_params(completion, 1)
            check_context(ctx, prompt, params.max_tokens, "prompt", "max_tokens")
            options = engine_options(ctx, completion)
        ctx.metrics.observe_params(params.n, params.max_tokens)
        return _PreparedTurn(prompt, params, options)

    async def _stream_into(self, request_id: str, prepared: _PreparedTurn,
                           progress: _Progress) -> None:
        (outputs,) = await open_generations(self._ctx, [prepared.prompt], prepared.params,
                                            [request_id], prepared.options)
        # Closing the stream early (error, deadline) aborts the request in the engine.
        async with aclosing(outputs):
            async for output in outputs:
                error = output_error(output)
                if error is not None:
                    raise error
                progress.observe(output)


@dataclass
class EngineSession:
    """An in-process engine opened for one run (see open_engine_session)."""

    ctx: ServerContext
    target: EngineTarget
    name: str = "in-process"
    url: None = None

    @property
    def model(self) -> str:
        return self.ctx.model_name

    @property
    def vocab_size(self) -> int:
        return self.ctx.vocab_size

    async def scrape(self) -> Samples:
        return registry_samples(self.ctx.engine.metrics)

    def client(self, output_tokens: int, clock_origin: float) -> InProcessClient:
        return InProcessClient(self.ctx, self.target, output_tokens, clock_origin)


@asynccontextmanager
async def open_engine_session(target: EngineTarget) -> AsyncIterator[EngineSession]:
    """Load the model, start the engine thread; stop it when the run ends."""
    # Loading blocks the event loop, which has nothing else to do before the run starts.
    async_llm = AsyncLLM(lambda: Engine(target.engine))
    engine = async_llm.engine
    try:
        model_arg = target.engine.model.model
        # The name `kvtier serve` would serve the model under (no --served-model-name).
        names = (model_arg or engine.model_name,)
        ctx = ServerContext(async_llm, names, model_arg, api_key=None,
                            metrics=ServerMetrics(engine.metrics))
        yield EngineSession(ctx, target)
    finally:
        async_llm.shutdown(drain_timeout_s=_DRAIN_TIMEOUT_S)
