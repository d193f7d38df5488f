"""Replays a request trace against a target on the trace's own (scaled) clock.

Each request is sent at its scaled arrival time, whether or not earlier ones have finished (an
open loop, as production traffic arrives); `max_concurrency` optionally bounds how many are in
flight, and then requests start in arrival order as slots free up. Prompts go to
/v1/completions as token ids with `max_tokens` = the scaled output length and `ignore_eos`, so
every reply is as long as the trace says.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvtier.entrypoints.bench.client import BenchSession, RequestResult, TurnClient
from kvtier.entrypoints.bench.config import BenchTarget
from kvtier.entrypoints.bench.metrics_scrape import tier_hits
from kvtier.entrypoints.bench.report import request_summary
from kvtier.entrypoints.bench.runner import BenchTimeoutError, open_session
from kvtier.entrypoints.bench.trace import (
    BlockTokens,
    ScaledRequest,
    TraceScaling,
    load_trace,
    scale_trace,
)
from kvtier.entrypoints.bench.workload import ConversationId

COMPLETIONS_PATH = "/v1/completions"

# Every key the trace report has, whatever the target ("url" is None in process).
TRACE_REPORT_FIELDS = (
    "label", "url", "model", "api", "trace", "scaling", "max_concurrency", "num_requests",
    "num_failed", "duration_s", "ttft_s", "tpot_s", "latency_s", "input_tokens",
    "output_tokens", "input_tokens_per_s", "output_tokens_per_s", "requests_per_s",
    "hit_rates", "errors", "requests",
)


@dataclass(frozen=True)
class TraceReplayConfig:
    """What to replay and how: the trace file, its scaling, an optional bound on concurrency."""

    trace: Path
    scaling: TraceScaling = TraceScaling()
    max_concurrency: int | None = None

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("TraceReplayConfig.max_concurrency must be >= 1 or None, "
                             f"got {self.max_concurrency}")


def completion_body(model: str, token_ids: list[int], output_tokens: int) -> dict[str, Any]:
    """A streaming /v1/completions body whose reply is exactly `output_tokens` long."""
    return {
        "model": model,
        "prompt": token_ids,
        "max_tokens": output_tokens,
        # vLLM's extension, which kvtier's server has too: no early stop at an EOS token.
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def run_trace(config: TraceReplayConfig, target: BenchTarget, label: str = "",
                    show_progress: bool = True) -> dict[str, Any]:
    """Replay the trace and return the report (see TRACE_REPORT_FIELDS)."""
    requests = scale_trace(load_trace(config.trace), config.scaling)
    # A connection per request in flight: a pool wait would delay arrivals the trace timed.
    max_connections = config.max_concurrency or len(requests)
    async with open_session(target, max_connections) as session:
        tokens = BlockTokens(config.scaling.tokens_per_block, _vocab_size(config, session),
                             config.scaling.seed)
        before = await session.scrape()
        started = time.perf_counter()
        # Each body carries its own max_tokens: the client's default length is never used.
        client = session.client(1, started)
        with tqdm(total=len(requests), unit="req", desc=label or "trace",
                  disable=not show_progress) as bar:
            results = await _replay(requests, tokens, client, session.model, config, bar,
                                    target.run_timeout_s)
        duration = time.perf_counter() - started
        after = await session.scrape()
    hits = tier_hits(before, after) if before is not None and after is not None else {}
    return {
        "label": label or session.name,
        "url": session.url,
        "model": session.model,
        "api": "completions",
        "trace": str(config.trace),
        "scaling": asdict(config.scaling),
        "max_concurrency": config.max_concurrency,
        **_summary(results, duration, hits),
        "requests": [_request_row(request, result)
                     for request, result in zip(requests, results, strict=True)],
    }


def _vocab_size(config: TraceReplayConfig, session: BenchSession) -> int:
    vocab_size = config.scaling.vocab_size or session.vocab_size
    if vocab_size is None:
        raise ValueError("the server does not say its vocabulary size; pass --vocab-size (token "
                         "ids are drawn below it)")
    return vocab_size


def _summary(results: list[RequestResult], duration_s: float, hits: dict) -> dict[str, Any]:
    summary = request_summary(results, duration_s, hits)
    return {"num_requests": summary.pop("num_requests"), "num_failed": summary.pop("num_failed"),
            "duration_s": duration_s, **summary}


def _request_row(request: ScaledRequest, result: RequestResult) -> dict[str, Any]:
    return {"index": request.index, "arrival_s": request.arrival_s, "start_s": result.start_s,
            "prompt_tokens": request.num_prompt_tokens, "output_tokens": result.num_output_tokens,
            "ttft_s": result.ttft_s, "latency_s": result.latency_s, "error": result.error}


async def _replay(requests: list[ScaledRequest], tokens: BlockTokens, client: TurnClient,
                  model: str, config: TraceReplayConfig, bar: tqdm,
                  deadline_s: float) -> list[RequestResult]:
    try:
        async with asyncio.timeout(deadline_s):
            return await _dispatch(requests, tokens, client, model, config, bar)
    except TimeoutError as exc:
        raise BenchTimeoutError(f"trace replay exceeded {deadline_s} s; raise the run timeout, "
                                "or scale the trace down (--max-requests, --time-scale)") from exc


async def _dispatch(requests: list[ScaledRequest], tokens: BlockTokens, client: TurnClient,
                    model: str, config: TraceReplayConfig, bar: tqdm) -> list[RequestResult]:
    """Start each request at its arrival time (and a free slot), in arrival order."""
    slots = asyncio.Semaphore(config.max_concurrency or len(requests))
    loop = asyncio.get_running_loop()
    origin = loop.time()
    tasks: list[asyncio.Task[RequestResult]] = []
    try:
        for request in requests:
            await asyncio.sleep(max(0.0, origin + request.arrival_s - loop.time()))
            await slots.acquire()
            body = completion_body(model, tokens.prompt(request), request.output_tokens)
            tasks.append(asyncio.create_task(_send(request, body, client, slots, bar)))
        return list(await asyncio.gather(*tasks))
    finally:
        # Cut off by the deadline: no request outlives the replay (a no-op once all are done).
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _send(request: ScaledRequest, body: dict[str, Any], client: TurnClient,
                slots: asyncio.Semaphore, bar: tqdm) -> RequestResult:
    try:
        return await client.send_body(ConversationId(request.index), 0, COMPLETIONS_PATH, body)
    finally:
        slots.release()
        bar.update(1)
