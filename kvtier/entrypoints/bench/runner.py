"""Runs the multi-turn workload against a target: N concurrent conversations of T turns.

The target is an OpenAI-compatible server (ServerTarget) or a kvtier engine built in this process
(EngineTarget); the workload, the timing and the report are the same for both.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import AbstractAsyncContextManager
from typing import Any

from tqdm import tqdm

from kvtier.entrypoints.bench.client import (
    BenchSession,
    RequestResult,
    TurnClient,
    open_server_session,
)
from kvtier.entrypoints.bench.config import ApiKind, BenchTarget, EngineTarget, MultiTurnConfig
from kvtier.entrypoints.bench.metrics_scrape import tier_hits
from kvtier.entrypoints.bench.report import summarize
from kvtier.entrypoints.bench.workload import ConversationScript, build_conversations


class BenchTimeoutError(TimeoutError):
    """The run did not finish within the target's run_timeout_s."""


async def run_multi_turn(config: MultiTurnConfig, target: BenchTarget, label: str = "",
                         show_progress: bool = True) -> dict[str, Any]:
    """Drive all conversations concurrently and return the report (see report.REPORT_FIELDS)."""
    # One connection per conversation: turns of a conversation are sequential, so this is
    # exactly the concurrency the workload asks for.
    async with open_session(target, max_connections=config.num_conversations) as session:
        return await run_multi_turn_on(session, config, target.api, target.run_timeout_s, label,
                                       show_progress)


async def run_multi_turn_on(session: BenchSession, config: MultiTurnConfig, api: ApiKind,
                            run_timeout_s: float, label: str = "",
                            show_progress: bool = True) -> dict[str, Any]:
    """run_multi_turn on a session opened by the caller: any BenchSession, e.g. several servers
    behind one client that spreads the turns over them."""
    scripts = build_conversations(config)
    before = await session.scrape()
    started = time.perf_counter()
    client = session.client(config.output_tokens, started)
    with tqdm(total=config.num_conversations * config.num_turns, unit="req",
              desc=label or "multi-turn", disable=not show_progress) as bar:
        results = await _run_all(scripts, client, config, bar, run_timeout_s)
    duration = time.perf_counter() - started
    after = await session.scrape()
    hits = tier_hits(before, after) if before is not None and after is not None else {}
    return summarize(results, duration, config, session.url, api, session.model, hits,
                     label or session.name)


def open_session(target: BenchTarget,
                 max_connections: int) -> AbstractAsyncContextManager[BenchSession]:
    """The target opened for one run; a server gets up to `max_connections` connections."""
    if isinstance(target, EngineTarget):
        # Imported here: it loads torch and the server's modules, which a server run never needs.
        from kvtier.entrypoints.bench.engine_client import open_engine_session
        return open_engine_session(target)
    return open_server_session(target, max_connections=max_connections)


async def _run_all(scripts: list[ConversationScript], client: TurnClient,
                   config: MultiTurnConfig, bar: tqdm, deadline_s: float) -> list[RequestResult]:
    tasks = [_run_conversation(script, client, config, bar) for script in scripts]
    try:
        per_conversation = await asyncio.wait_for(asyncio.gather(*tasks), timeout=deadline_s)
    except TimeoutError as exc:
        raise BenchTimeoutError(f"multi-turn run exceeded {deadline_s} s; raise the run "
                                "timeout or shrink the workload") from exc
    return [result for results in per_conversation for result in results]


async def _run_conversation(script: ConversationScript, client: TurnClient,
                            config: MultiTurnConfig, bar: tqdm) -> list[RequestResult]:
    history = [{"role": "system", "content": script.system_prompt}]
    results = []
    if config.start_interval_s > 0.0 and script.conversation_id > 0:
        await asyncio.sleep(script.conversation_id * config.start_interval_s)
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
