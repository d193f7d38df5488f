"""Forwards one OpenAI request to the chosen instance, streaming included.

A request that fails on an instance before any byte of its answer reached the client (the
instance cannot be reached, drops the connection, or answers 502/503/504) is tried on another,
up to `max_attempts` instances; the instance that could not be reached is marked down at once.
When every try failed the client gets the last instance's answer (a 503 with its Retry-After),
or a 502 naming the failures. An instance that sends nothing for `read_timeout_s` is slow, not
down: the client gets a 504 and the request is not tried elsewhere. Once bytes have been
relayed the answer is the instance's, to the end; an instance lost mid-stream ends the stream
with an error event. A client that leaves cancels its request on the instance.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, NoReturn

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from kvtier.entrypoints.openai.connection import cancel_on_disconnect
from kvtier.entrypoints.openai.errors import (
    APIError,
    BadRequestError,
    ServiceUnavailableError,
    anthropic_error_event,
    speaks_anthropic,
)
from kvtier.entrypoints.openai.streaming import sse_error
from kvtier.router.disagg import with_prefilled_kv
from kvtier.router.instances import Instance
from kvtier.router.policy import Decision, NoInstanceError
from kvtier.router.prompts import GENERATION_PATHS, RESPONSES_PATH
from kvtier.router.responses import owner_of, previous_response_id, response_id_in
from kvtier.router.service import RouterService

# The client's key goes on as it came: Authorization, or x-api-key as Anthropic's clients send
# it.
_REQUEST_HEADERS = ("authorization", "x-api-key", "content-type", "x-request-id")
_RESPONSE_HEADERS = ("content-type", "x-request-id", "retry-after", "cache-control",
                     "x-accel-buffering")
_RETRY_STATUSES = frozenset({502, 503, 504})
# Names the instance that answered, on every proxied response.
INSTANCE_HEADER = "x-kvtier-instance"
# Prompts of more characters than this are tokenized off the event loop.
_INLINE_BODY_BYTES = 16_384


class BadGatewayError(APIError):
    status_code = 502
    error_type = "bad_gateway_error"


class GatewayTimeoutError(APIError):
    status_code = 504
    error_type = "gateway_timeout_error"


class _TryElsewhere(Exception):
    """Nothing was relayed yet: the request may go to another instance. `answer`: the
    instance's own answer (a 503, say), which the client gets if no other instance does
    better."""

    def __init__(self, reason: str, answer: Response | None = None) -> None:
        super().__init__(reason)
        self.answer = answer


@dataclass(frozen=True)
class _Prompt:
    num_tokens: int
    block_hashes: list[int]


async def explain(service: RouterService, raw: Request) -> dict[str, Any]:
    """What the router would do with {"path": ..., "body": ...}, without sending it: the
    decision and, per instance, the prompt's cached prefix the index knows of."""
    content = await raw.body()
    request = _json_object(content)
    path, body = request.get("path"), request.get("body")
    if path not in GENERATION_PATHS or not isinstance(body, dict):
        paths = ", ".join(f'"{p}"' for p in GENERATION_PATHS)
        raise BadRequestError(f'give {{"path": one of {paths}, "body": {{...}}}}', param="path",
                              code="invalid_value")
    prompt = await _hash_prompt(service, path, body, len(content))
    block_size = service.hasher.block_size if service.hasher is not None else 1
    router = service.router
    owner = await _owner(service, path, body, dict(raw.headers))
    decision = Decision(owner, "response_owner", 0) if owner is not None else \
        router.choose(prompt.block_hashes, block_size, num_prompt_tokens=prompt.num_tokens)
    matches = router.matches(prompt.block_hashes, service.instances)
    prefill = None
    if service.prefill_router is not None and previous_response_id(path, body) is None:
        with contextlib.suppress(NoInstanceError):  # the decode instance computes the prompt
            prefill = service.prefill_router.choose(prompt.block_hashes, block_size).instance.url
    return {"instance": decision.instance.url, "reason": decision.reason,
            "prefill_instance": prefill,
            "num_prompt_blocks": len(prompt.block_hashes),
            "predicted_cached_tokens": decision.predicted_cached_tokens,
            "prefill_tokens": decision.prefill_tokens,
            "instances": [{"url": i.url, "healthy": i.healthy, "load": i.load,
                           "queued_tokens": i.queued_tokens,
                           "cached_blocks": m.num_blocks if m else 0,
                           "weighted_blocks": m.weighted_blocks if m else 0.0,
                           "cost_tokens": router.cost(i, m, prompt.num_tokens, block_size)}
                          for i in service.instances for m in [matches.get(i.slot)]]}


async def proxy(service: RouterService, path: str, raw: Request) -> Response:
    content = await raw.body()
    body = _json_object(content)
    headers = {name: raw.headers[name] for name in _REQUEST_HEADERS if name in raw.headers}
    answer = await cancel_on_disconnect(raw, _route(service, path, content, body, headers))
    return Response(status_code=499) if answer is None else answer  # None: the client left


async def _route(service: RouterService, path: str, content: bytes, body: dict[str, Any],
                 headers: dict[str, str]) -> Response:
    prompt = await _hash_prompt(service, path, body, len(content))
    block_size = service.hasher.block_size if service.hasher is not None else 1
    tried: set[str] = set()
    failures: list[str] = []
    last_answer: Response | None = None
    owner = await _owner(service, path, body, headers)
    for _ in range(1 if owner is not None else service.config.max_attempts):
        try:
            # A response that goes on from a stored one goes where that one is stored.
            decision = Decision(owner, "response_owner", 0) if owner is not None else \
                service.router.choose(prompt.block_hashes, block_size, frozenset(tried),
                                      prompt.num_tokens)
        except NoInstanceError:
            break
        service.metrics.decisions.labels(service.config.policy, decision.reason).inc()
        tried.add(decision.instance.url)
        sent = content
        if service.prefill_router is not None and previous_response_id(path, body) is None:
            uncached = prompt.num_tokens - decision.predicted_cached_tokens \
                if prompt.num_tokens and service.config.local_prefill_tokens else None
            sent = await with_prefilled_kv(service, path, body, headers, prompt.block_hashes,
                                           decision.instance, uncached)
        try:
            return await _forward(service, decision, path, sent, headers, prompt,
                                  body.get("stream") is True)
        except _TryElsewhere as exc:
            service.metrics.retries.labels(str(exc)).inc()
            failures.append(f"{decision.instance.url}: {exc}")
            last_answer = exc.answer or last_answer
    service.metrics.requests.labels("failed").inc()
    if not tried:
        raise ServiceUnavailableError("no instance is healthy; try again later",
                                      code="no_instance")
    if last_answer is not None:
        return last_answer
    raise BadGatewayError(f"the request failed on {len(tried)} instance(s) before any answer "
                          f"({'; '.join(failures)})", code="upstream_failed")


async def _owner(service: RouterService, path: str, body: dict[str, Any],
                 headers: dict[str, str]) -> Instance | None:
    """The instance a Responses request that goes on from a stored response must go to (the
    one that stores it), or None: the policy chooses (and a request naming a response no
    healthy instance stores gets that instance's 404)."""
    previous = previous_response_id(path, body)
    return None if previous is None else await owner_of(service, previous, headers)


async def from_any_instance(service: RouterService, path: str, raw: Request) -> Response:
    """The request (a GET, or a POST that generates nothing) answered by the first healthy
    instance that answers (all serve the same model), the client's key passed on."""
    headers = {name: raw.headers[name] for name in _REQUEST_HEADERS if name in raw.headers}
    content = await raw.body()
    for instance in service.router.instances:
        if not instance.healthy:
            continue
        try:
            upstream = await service.client.request(raw.method, instance.url + path,
                                                    headers=headers, content=content)
        except httpx.TransportError as exc:
            if not isinstance(exc, httpx.TimeoutException):
                service.mark_down(instance, "unreachable")
            continue
        return Response(upstream.content, upstream.status_code,
                        media_type=upstream.headers.get("content-type"))
    raise ServiceUnavailableError("no instance is healthy", code="no_instance")


def _json_object(content: bytes) -> dict[str, Any]:
    try:
        body = json.loads(content)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequestError(f"the body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise BadRequestError("the body must be a JSON object", code="invalid_json")
    return body


async def _hash_prompt(service: RouterService, path: str, body: dict[str, Any],
                       num_bytes: int) -> _Prompt:
    hasher = service.hasher
    if hasher is None or service.config.policy != "kv-aware":
        return _Prompt(0, [])
    if num_bytes > _INLINE_BODY_BYTES:  # a long prompt would stall every other request
        token_ids = await asyncio.to_thread(hasher.token_ids, path, body)
    else:
        token_ids = hasher.token_ids(path, body)
    if not token_ids:
        return _Prompt(0, [])
    return _Prompt(len(token_ids), hasher.block_hashes_of(token_ids, body.get("cache_salt"),
                                                          body.get("model")))


async def _forward(service: RouterService, decision: Decision, path: str, content: bytes,
                   headers: dict[str, str], prompt: _Prompt, stream: bool) -> Response:
    instance = decision.instance
    service.add_in_flight(instance, 1)
    service.add_queued_tokens(instance, decision.prefill_tokens)
    relaying = False
    try:
        upstream = await _send(service, instance, path, content, headers)
        out_headers = {k: upstream.headers[k] for k in _RESPONSE_HEADERS if k in upstream.headers}
        out_headers[INSTANCE_HEADER] = instance.url
        if upstream.status_code in _RETRY_STATUSES:
            body = await _read_all(service, instance, upstream)
            raise _TryElsewhere(f"status_{upstream.status_code}",
                                Response(body, upstream.status_code, out_headers))
        if not stream or upstream.status_code != 200:
            body = await _read_all(service, instance, upstream)
            _observe(service, decision, prompt, _usage_of(body), upstream.status_code)
            if path == RESPONSES_PATH and upstream.status_code == 200:
                _learn_owner(service, response_id_in(body), instance)
            return Response(body, upstream.status_code, out_headers)
        chunks = upstream.aiter_raw()
        try:
            first = await anext(chunks, b"")
        except httpx.TransportError as exc:
            await upstream.aclose()
            _raise_for(service, instance, exc)
        relaying = True
        return StreamingResponse(_relay(service, decision, path, prompt, upstream, first,
                                        chunks), upstream.status_code, out_headers)
    finally:
        # The first token is out (a stream's first bytes), the answer is whole, or the request
        # failed: its prompt no longer waits ahead of the next request's.
        service.add_queued_tokens(instance, -decision.prefill_tokens)
        if not relaying:
            service.add_in_flight(instance, -1)


async def _send(service: RouterService, instance: Instance, path: str, content: bytes,
                headers: dict[str, str]) -> httpx.Response:
    request = service.client.build_request("POST", instance.url + path, content=content,
                                           headers=headers)
    try:
        return await service.client.send(request, stream=True)
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        service.mark_down(instance, "unreachable")
        raise _TryElsewhere("unreachable") from exc
    except httpx.TransportError as exc:
        _raise_for(service, instance, exc)


async def _read_all(service: RouterService, instance: Instance,
                    upstream: httpx.Response) -> bytes:
    try:
        return await upstream.aread()
    except httpx.TransportError as exc:
        _raise_for(service, instance, exc)
    finally:
        await upstream.aclose()


def _raise_for(service: RouterService, instance: Instance,
               exc: httpx.TransportError) -> NoReturn:
    """A 504 when the instance is only slow (it stays in routing: another would be as slow,
    and its request ends as the connection closes); else the instance is down."""
    if isinstance(exc, httpx.TimeoutException):
        service.metrics.requests.labels("timeout").inc()
        raise GatewayTimeoutError(
            f"instance {instance.url} sent nothing for {service.config.read_timeout_s:g} s; "
            "stream long answers, or raise the router's --read-timeout",
            code="upstream_timeout") from exc
    service.mark_down(instance, "connection_lost")
    raise _TryElsewhere("connection_lost") from exc


async def _relay(service: RouterService, decision: Decision, path: str, prompt: _Prompt,
                 upstream: httpx.Response, first: bytes,
                 chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    scanner = _UsageScanner()
    outcome = 200
    try:
        scanner.feed(first)
        yield first
        async for chunk in chunks:
            scanner.feed(chunk)
            yield chunk
    except httpx.TransportError as exc:
        # Bytes already reached the client: the stream ends with an error event (after the
        # end of an event cut short), and without its end marker.
        outcome = 502
        if not isinstance(exc, httpx.TimeoutException):
            service.mark_down(decision.instance, "connection_lost")
        yield b"\n\n" if scanner.mid_event else b""
        error = BadGatewayError(f"instance {decision.instance.url} failed mid-answer "
                                f"({type(exc).__name__})", code="upstream_failed")
        yield (anthropic_error_event(error) if speaks_anthropic(path)
               else sse_error(error)).encode()
    finally:
        # Before the await: a client that left cancels this generator, and the await may
        # raise again.
        service.add_in_flight(decision.instance, -1)
        _observe(service, decision, prompt, scanner.usage, outcome)
        _learn_owner(service, scanner.response_id, decision.instance)
        await upstream.aclose()


def _observe(service: RouterService, decision: Decision, prompt: _Prompt,
             usage: dict[str, Any] | None, status: int) -> None:
    """Count the outcome, predicted against reported cached tokens, and whether the instance
    now owes the index events (it computed blocks the index did not know it had)."""
    metrics = service.metrics
    metrics.requests.labels("ok" if status < 400 else f"status_{status // 100}xx").inc()
    if status >= 400:
        return
    instance = decision.instance
    block_size = service.hasher.block_size if service.hasher is not None else 1
    service.expect_events(instance, len(prompt.block_hashes)
                          - decision.predicted_cached_tokens // block_size)
    details = (usage or {}).get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    if isinstance(cached, int):
        # The engine always computes the last prompt token: it is never reported cached.
        predicted = min(decision.predicted_cached_tokens, max(prompt.num_tokens - 1, 0))
        metrics.prompt_tokens.inc(usage.get("prompt_tokens", 0))
        metrics.predicted_cached.inc(predicted)
        metrics.actual_cached.inc(cached)


def _learn_owner(service: RouterService, response_id: str | None, instance: Instance) -> None:
    if response_id is not None:
        service.response_owners.learn(response_id, instance.url)


def _usage_of(body: bytes) -> dict[str, Any] | None:
    try:
        usage = json.loads(body).get("usage")
    except (ValueError, AttributeError):
        return None
    return usage if isinstance(usage, dict) else None


class _UsageScanner:
    """Finds the usage block in a server-sent event stream (the last chunk carries it with
    stream_options.include_usage), whatever the chunk boundaries."""

    def __init__(self) -> None:
        self.usage: dict[str, Any] | None = None
        # A Responses stream's response id (its first event).
        self.response_id: str | None = None
        self._partial = b""
        self._blank_line_last = True

    @property
    def mid_event(self) -> bool:
        """Whether the bytes fed so far end inside an event (not after its blank line)."""
        return bool(self._partial) or not self._blank_line_last

    def feed(self, chunk: bytes) -> None:
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        if lines:
            self._blank_line_last = lines[-1] == b""
        for line in lines:
            if self.response_id is None and line.startswith(b"data: {") \
                    and b'"response.created"' in line:
                self.response_id = response_id_in(line)
            if line.startswith(b"data: {") and b'"usage"' in line:
                usage = _usage_of(line[len(b"data: "):])
                self.usage = usage or self.usage
