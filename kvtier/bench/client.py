"""Streaming OpenAI-compatible client that times each request (TTFT, TPOT)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from kvtier.bench.config import ServerTarget
from kvtier.bench.workload import ConversationId, render_completion_prompt


class BenchClientError(RuntimeError):
    """The server could not be used for the benchmark (unreachable, no model listed)."""


@dataclass(frozen=True)
class RequestResult:
    """Timing and token counts of one turn; times are seconds, `start_s` from the run's start."""

    conversation_id: ConversationId
    turn: int
    start_s: float
    ttft_s: float | None  # None: no token arrived
    latency_s: float
    output_text: str
    num_prompt_tokens: int | None  # None: the server sent no usage
    num_output_tokens: int
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first one."""
        if self.ttft_s is None or self.num_output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.num_output_tokens - 1)


@dataclass
class _Stream:
    """What has arrived so far on one response stream."""

    first_token_at: float | None = None
    text: str = ""
    num_chunks: int = 0
    usage: dict[str, Any] | None = None


async def resolve_model(http: httpx.AsyncClient, target: ServerTarget) -> str:
    """The model to request: the configured one, else the first the server lists."""
    if target.model is not None:
        return target.model
    try:
        response = await http.get(f"{target.base_url}/v1/models", timeout=target.request_timeout_s)
        response.raise_for_status()
        models = response.json()["data"]
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        raise BenchClientError(f"cannot list models at {target.base_url}/v1/models: {exc}") from exc
    if not models:
        raise BenchClientError(f"{target.base_url}/v1/models lists no model; pass --model")
    return models[0]["id"]


class OpenAIStreamClient:
    """Sends one turn of a conversation as a streaming request and times it."""

    def __init__(self, http: httpx.AsyncClient, target: ServerTarget, model: str,
                 output_tokens: int, clock_origin: float) -> None:
        self._http = http
        self._target = target
        self._model = model
        self._output_tokens = output_tokens
        self._origin = clock_origin

    def _request_body(self, messages: list[dict[str, str]]) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {
            "model": self._model,
            "max_tokens": self._output_tokens,
            # Fixed output lengths make runs comparable; ignore_eos is vLLM's extension.
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self._target.api == "chat":
            return "/v1/chat/completions", {**body, "messages": messages}
        return "/v1/completions", {**body, "prompt": render_completion_prompt(messages)}

    async def send(self, conversation_id: ConversationId, turn: int,
                   messages: list[dict[str, str]]) -> RequestResult:
        """Stream one request; errors are recorded in the result, not raised."""
        path, body = self._request_body(messages)
        started = time.perf_counter()
        stream = _Stream()
        error = None
        try:
            # httpx's timeout bounds each read; this one bounds the whole request.
            async with asyncio.timeout(self._target.request_timeout_s):
                await self._stream_into(path, body, stream)
        except TimeoutError:
            error = f"TimeoutError: no complete reply in {self._target.request_timeout_s} s"
        except (httpx.HTTPError, BenchClientError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        finished = time.perf_counter()
        return self._result(conversation_id, turn, started, finished, stream, error)

    async def _stream_into(self, path: str, body: dict[str, Any], stream: _Stream) -> None:
        async with self._http.stream("POST", f"{self._target.base_url}{path}", json=body,
                                     timeout=self._target.request_timeout_s) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:200]
                raise BenchClientError(f"HTTP {response.status_code}: {detail}")
            async for line in response.aiter_lines():
                self._consume_line(line, stream)

    def _consume_line(self, line: str, stream: _Stream) -> None:
        if not line.startswith("data:"):
            return
        payload = line[len("data:"):].strip()
        if payload == "[DONE]":
            return
        chunk = json.loads(payload)
        if "error" in chunk:
            # A failure after the 200 status arrives in-band; the turn did not complete.
            error = chunk["error"]
            message = error.get("message") if isinstance(error, dict) else error
            raise BenchClientError(f"error event in the stream: {message}")
        if chunk.get("usage"):
            stream.usage = chunk["usage"]
        for choice in chunk.get("choices", []):
            piece = choice["delta"].get("content") if "delta" in choice else choice.get("text")
            if piece:
                if stream.first_token_at is None:
                    stream.first_token_at = time.perf_counter()
                stream.text += piece
                stream.num_chunks += 1

    def _result(self, conversation_id: ConversationId, turn: int, started: float,
                finished: float, stream: _Stream, error: str | None) -> RequestResult:
        usage = stream.usage or {}
        ttft = None if stream.first_token_at is None else stream.first_token_at - started
        return RequestResult(
            conversation_id=conversation_id,
            turn=turn,
            start_s=started - self._origin,
            ttft_s=ttft,
            latency_s=finished - started,
            output_text=stream.text,
            num_prompt_tokens=usage.get("prompt_tokens"),
            # Without usage, one streamed chunk is counted as one token (how servers stream).
            num_output_tokens=usage.get("completion_tokens", stream.num_chunks),
            error=error,
        )
