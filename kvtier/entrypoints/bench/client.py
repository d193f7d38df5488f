"""Streaming OpenAI-compatible client that times each request (TTFT, TPOT)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from kvtier.entrypoints.bench.config import ApiKind, ServerTarget
from kvtier.entrypoints.bench.metrics_scrape import Samples, scrape
from kvtier.entrypoints.bench.workload import ConversationId, render_completion_prompt


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


class TurnClient(Protocol):
    """Sends one request and times it; a failure is recorded in the result, never raised."""

    async def send(self, conversation_id: ConversationId, turn: int,
                   messages: list[dict[str, str]]) -> RequestResult:
        """One turn of a conversation, as request_body shapes it for the target's api."""

    async def send_body(self, conversation_id: ConversationId, turn: int, path: str,
                        body: dict[str, Any]) -> RequestResult:
        """A ready request body for the endpoint `path` (a streaming one)."""


class BenchSession(Protocol):
    """A target opened for one run: the model it serves, its metrics, a client per run."""

    @property
    def model(self) -> str:
        """The model name the report carries."""

    @property
    def name(self) -> str:
        """The report's label when the run has none."""

    @property
    def url(self) -> str | None:
        """The report's url; None when no HTTP is involved."""

    @property
    def vocab_size(self) -> int | None:
        """The model's vocabulary size; None when the target does not say."""

    async def scrape(self) -> Samples | None:
        """Every metrics sample now, or None when the target has no metrics."""

    def client(self, output_tokens: int, clock_origin: float) -> TurnClient: ...


def request_body(api: ApiKind, model: str, messages: list[dict[str, str]],
                 output_tokens: int) -> tuple[str, dict[str, Any]]:
    """The endpoint path and JSON body of one turn; every target sends exactly this."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": output_tokens,
        # Fixed output lengths make runs comparable; ignore_eos is vLLM's extension.
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if api == "chat":
        return "/v1/chat/completions", {**body, "messages": messages}
    if api == "responses":
        fields = {k: v for k, v in body.items() if k not in ("stream_options", "max_tokens")}
        return "/v1/responses", {**fields, "max_output_tokens": output_tokens,
                                 "input": messages}
    if api == "messages":  # Anthropic's: the system prompt beside the messages
        fields = {k: v for k, v in body.items() if k != "stream_options"}
        system = [m["content"] for m in messages if m["role"] == "system"]
        turns = [m for m in messages if m["role"] != "system"]
        return "/v1/messages", {**fields, "messages": turns,
                                **({"system": "\n".join(system)} if system else {})}
    return "/v1/completions", {**body, "prompt": render_completion_prompt(messages)}


def new_messages(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """The messages after the last assistant one: what a Responses turn sends beside the
    previous_response_id (the server holds the rest)."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    return messages[last + 1:]


# The event types of an Anthropic Messages stream the client reads.
_MESSAGES_EVENTS = ("content_block_delta", "message_delta", "error")


@dataclass
class _Stream:
    """What has arrived so far on one response stream."""

    first_token_at: float | None = None
    text: str = ""
    num_chunks: int = 0
    usage: dict[str, Any] | None = None
    # A Responses stream's response id.
    response_id: str | None = None


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
        # api "responses": each conversation's last response id.
        self._last_response: dict[ConversationId, str] = {}

    async def send(self, conversation_id: ConversationId, turn: int,
                   messages: list[dict[str, str]]) -> RequestResult:
        """Stream one turn; errors are recorded in the result, not raised."""
        previous = self._last_response.get(conversation_id)
        if previous is not None:
            messages = new_messages(messages)
        path, body = request_body(self._target.api, self._model, messages, self._output_tokens)
        if previous is not None:
            body["previous_response_id"] = previous
        return await self.send_body(conversation_id, turn, path, body)

    async def send_body(self, conversation_id: ConversationId, turn: int, path: str,
                        body: dict[str, Any]) -> RequestResult:
        """Stream one request; errors are recorded in the result, not raised."""
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
        if stream.response_id is not None and error is None:
            self._last_response[conversation_id] = stream.response_id
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
        kind = chunk.get("type")
        if isinstance(kind, str) and kind.startswith("response."):
            self._consume_event(chunk, stream)
            return
        if kind in _MESSAGES_EVENTS:
            self._consume_message_event(chunk, stream)
            return
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
                self._add_piece(piece, stream)

    def _consume_event(self, event: dict[str, Any], stream: _Stream) -> None:
        """One event of a Responses stream."""
        kind = event["type"]
        if kind == "response.output_text.delta" and event.get("delta"):
            self._add_piece(event["delta"], stream)
        elif kind == "response.created":
            stream.response_id = event["response"]["id"]
        elif kind in ("response.completed", "response.incomplete"):
            usage = event["response"].get("usage") or {}
            stream.usage = {"prompt_tokens": usage.get("input_tokens"),
                            "completion_tokens": usage.get("output_tokens")}
        elif kind == "response.failed":
            error = event["response"].get("error") or {}
            raise BenchClientError(f"response failed: {error.get('message')}")

    def _consume_message_event(self, event: dict[str, Any], stream: _Stream) -> None:
        """One event of an Anthropic Messages stream."""
        kind = event["type"]
        if kind == "content_block_delta" and event["delta"].get("text"):
            self._add_piece(event["delta"]["text"], stream)
        elif kind == "message_delta":
            usage = event.get("usage") or {}
            stream.usage = {"prompt_tokens": (usage.get("input_tokens") or 0)
                            + (usage.get("cache_read_input_tokens") or 0)
                            + (usage.get("cache_creation_input_tokens") or 0),
                            "completion_tokens": usage.get("output_tokens")}
        elif kind == "error":
            raise BenchClientError(f"error event in the stream: "
                                   f"{(event.get('error') or {}).get('message')}")

    @staticmethod
    def _add_piece(piece: str, stream: _Stream) -> None:
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


@dataclass
class ServerSession:
    """An OpenAI-compatible server opened for one run (see open_server_session)."""

    http: httpx.AsyncClient
    target: ServerTarget
    model: str

    @property
    def name(self) -> str:
        return self.target.base_url

    @property
    def url(self) -> str:
        return self.target.base_url

    @property
    def vocab_size(self) -> None:
        # The OpenAI API has no field for it.
        return None

    async def scrape(self) -> Samples | None:
        return await scrape(self.http, self.target.base_url, self.target.request_timeout_s)

    def client(self, output_tokens: int, clock_origin: float) -> OpenAIStreamClient:
        return OpenAIStreamClient(self.http, self.target, self.model, output_tokens, clock_origin)


@asynccontextmanager
async def open_server_session(target: ServerTarget,
                              max_connections: int) -> AsyncIterator[ServerSession]:
    """Connections to the server and the model to request; BenchClientError if unusable."""
    # Idle connections are dropped after 2 s, before a server closes them: uvicorn (kvtier's and
    # vLLM's server) closes a connection idle for 5 s, httpx's default expiry is also 5 s, and a
    # request sent on a connection the server is closing at that moment fails with a ReadError
    # (seen once in 1,280 requests at 256 conversations).
    limits = httpx.Limits(max_connections=max_connections, keepalive_expiry=2.0)
    async with httpx.AsyncClient(limits=limits) as http:
        yield ServerSession(http, target, await resolve_model(http, target))
