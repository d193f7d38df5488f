"""Server-sent events and the per-choice deltas between cumulative engine outputs."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from kvtier.engine.outputs import CompletionOutput
from kvtier.entrypoints.openai.errors import APIError
from kvtier.entrypoints.openai.protocol import (
    ErrorInfo,
    ErrorResponse,
    PromptTokensDetails,
    UsageInfo,
)
from kvtier.logprobs import SampleLogprobs

if TYPE_CHECKING:
    from kvtier.entrypoints.openai.context import ServerContext

DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_response(lines: AsyncIterator[str], headers: dict[str, str]) -> StreamingResponse:
    """A stream of server-sent events, with `headers` beside the ones every stream carries."""
    return StreamingResponse(lines, media_type="text/event-stream",
                             headers={**SSE_HEADERS, **headers})


def sse(body: BaseModel) -> str:
    return f"data: {body.model_dump_json()}\n\n"


def sse_error(error: APIError) -> str:
    info = ErrorInfo(message=error.message, type=error.error_type, param=error.param,
                     code=error.code)
    return f"data: {json.dumps(ErrorResponse(error=info).model_dump())}\n\n"


@dataclass(frozen=True)
class Delta:
    """What one choice gained since the last chunk sent for it."""

    text: str
    token_ids: list[int]
    logprobs: SampleLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None
    is_first: bool


class DeltaTracker:
    """Turns cumulative CompletionOutputs into deltas, one stream of them per choice index."""

    def __init__(self) -> None:
        # choice index -> (characters sent, tokens sent, finished sent)
        self._sent: dict[int, tuple[int, int, bool]] = {}

    def advance(self, index: int, completion: CompletionOutput) -> Delta | None:
        text_len, num_tokens, done = self._sent.get(index, (0, 0, False))
        if done:
            return None
        text = completion.text[text_len:]
        token_ids = completion.token_ids[num_tokens:]
        finished = completion.finish_reason is not None
        is_first = index not in self._sent
        if not (text or token_ids or finished or is_first):
            return None
        self._sent[index] = (len(completion.text), len(completion.token_ids), finished)
        logprobs = None if completion.logprobs is None else \
            completion.logprobs[num_tokens:num_tokens + len(token_ids)]
        return Delta(text, token_ids, logprobs, completion.finish_reason,
                     completion.stop_reason if finished else None, is_first)

    @property
    def num_completion_tokens(self) -> int:
        return sum(num_tokens for _, num_tokens, _ in self._sent.values())


def usage_info(ctx: ServerContext, num_prompt: int, num_completion: int,
               num_cached: int) -> UsageInfo:
    """The usage block; the cached token count only with --enable-prompt-tokens-details (it
    tells a client how much of its prompt another request had sent before)."""
    details = PromptTokensDetails(cached_tokens=num_cached) \
        if ctx.enable_prompt_tokens_details else None
    return UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_completion,
                     total_tokens=num_prompt + num_completion, prompt_tokens_details=details)
