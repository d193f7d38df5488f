"""Runs the multi-turn workload against a server: N concurrent conversations of T turns."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
from tqdm import tqdm

from kvtier.bench.client import OpenAIStreamClient, RequestResult, resolve_model
from kvtier.bench.config import MultiTurnConfig, ServerTarget
from kvtier.bench.metrics_scrape import scrape, tier_hits
from kvtier.bench.report import summarize
from kvtier.bench.workload import ConversationScript, build_conversations


class BenchTimeoutError(TimeoutError):
    """The run did not finish within ServerTarget.run_timeout_s."""


async def run_multi_turn(config: MultiTurnConfig, target: ServerTarget, label: str = "",
                         show_progress: bool = True) -> dict[str, Any]:
    """Drive all conversations concurrently and return the report (see report.REPORT_FIELDS)."""
    scripts = build_conversations(config)
    # One connection per conversation: turns of a conversation are sequential, so this is
    # exactly the concurrency the workload asks for.
    limits = httpx.Limits(max_connections=config.num_conversations)
    async with httpx.AsyncClient(limits=limits) as http:
        model = await resolve_model(http, target)
        before = await scrape(http, target.base_url, target.request_timeout_s)
        started = time.perf_counter()
        client = OpenAIStreamClient(http, target, model, config.output_tokens, started)
        with tqdm(total=config.num_conversations * config.num_turns, unit="req",
                  desc=label or "multi-turn", disable=not show_progress) as bar:
            results = await _run_all(scripts, client, config, bar, target.run_timeout_s)
        duration = time.perf_counter() - started
        after = await scrape(http, target.base_url, target.request_timeout_s)
    hits = tier_hits(before, after) if before is not None and after is not None else {}
    return summarize(results, duration, config, target, model, hits, label or target.base_url)


async def _run_all(scripts: list[ConversationScript], client: OpenAIStreamClient,
                   config: MultiTurnConfig, bar: tqdm, deadline_s: float) -> list[RequestResult]:
    tasks = [_run_conversation(script, client, config, bar) for script in scripts]
    try:
        per_conversation = await asyncio.wait_for(asyncio.gather(*tasks), timeout=deadline_s)
    except TimeoutError as exc:
        raise BenchTimeoutError(f"multi-turn run exceeded {deadline_s} s; raise the run "
                                "timeout or shrink the workload") from exc
    return [result for results in per_conversation for result in results]


async def _run_conversation(script: ConversationScript, client: OpenAIStreamClient,
                            config: MultiTurnConfig, bar: tqdm) -> list[RequestResult]:
    history = [{"role": "system", "content": script.system_prompt}]
    results = []
    for turn, user_message in enumerate(script.user_messages):
        if turn > 0 and config.think_time_s > 0.0:
            await asyncio.sleep(config.think_time_s)
        history.append({"role": "user", "content": user_message})
        result = await client.send(script.conversation_id, turn, history)
        results.append(result)
        bar.update(1)
        if result.error is not None:
            # Later turns would carry a history the server never produced: stop here.
            bar.update(len(script.user_messages) - turn - 1)
            break
        history.append({"role": "assistant", "content": result.output_text})
    return results
