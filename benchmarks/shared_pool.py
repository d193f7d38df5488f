"""Two instances behind one client: a shared KV pool (Valkey, S3) vs private host tiers.

Two `kvtier serve` instances of the default model (SmolLM2-135M) serve one multi-turn workload
(kvtier.entrypoints.bench) through one client that alternates each conversation's turns between
them: turn t of conversation c goes to instance (c + t) mod 2, as a router without affinity
would send it. So every turn lands on the instance that did not serve the turn before, and
reuses that turn's KV only if the instances share a pool. Configurations, one after another on
the same workload:
  private  each instance with its own host tier (--kv-offload host=SIZE)
  redis    host tier + one shared Valkey (redis tier)
  obj      host tier + one shared S3 bucket (obj tier)
Each run reports throughput, TTFT and the hit rate of every tier (device, host, the store), summed
over both instances.

    python benchmarks/shared_pool.py                              # private, redis, obj
    python benchmarks/shared_pool.py --configs private,redis --conversations 32
    python benchmarks/shared_pool.py --redis-url redis://10.0.0.5:6379/0 --configs private,redis
Without --redis-url / --s3-url each shared configuration starts a throwaway Valkey / SeaweedFS on
127.0.0.1 (the `stores` extra's binaries). Chunks go under a key prefix of this run, so a shared
server's older chunks are never hits. Run it from the repository root with kvtier installed (or
PYTHONPATH=.); it prints a Markdown table and writes every report as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import AsyncExitStack, ExitStack, contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "peer"))  # the server launcher

from server_process import ServerProcess, free_port  # noqa: E402
from store_throughput import store_pair  # noqa: E402

from kvtier.entrypoints.bench import MultiTurnConfig, ServerTarget, run_multi_turn_on  # noqa: E402
from kvtier.entrypoints.bench.client import (  # noqa: E402
    RequestResult,
    ServerSession,
    TurnClient,
    open_server_session,
)
from kvtier.entrypoints.bench.metrics_scrape import Samples  # noqa: E402
from kvtier.entrypoints.bench.workload import ConversationId  # noqa: E402
from kvtier.offload.config import parse_kv_offload  # noqa: E402

CONFIGS = ("private", "redis", "obj")
NUM_INSTANCES = 2
WARMUP_SEED_OFFSET = 1_000_000


@dataclasses.dataclass(frozen=True)
class PoolBenchConfig:
    configs: tuple[str, ...]
    workload: MultiTurnConfig
    device_kv_bytes: int
    max_model_len: int
    host_bytes: int
    redis_url: str | None  # None: a throwaway local Valkey
    s3_url: str | None  # s3://BUCKET/PREFIX; None: a throwaway local SeaweedFS
    startup_timeout_s: float
    run_timeout_s: float
    out_json: Path
    log_dir: Path

    def __post_init__(self) -> None:
        unknown = [c for c in self.configs if c not in CONFIGS]
        if unknown:
            raise ValueError(f"--configs has unknown {unknown}; choose from {CONFIGS}")


class AlternatingClient:
    """A TurnClient that sends turn t of conversation c to instance (c + t) mod n."""

    def __init__(self, clients: list[TurnClient]) -> None:
        self._clients = clients

    def _pick(self, conversation_id: ConversationId, turn: int) -> TurnClient:
        return self._clients[(conversation_id + turn) % len(self._clients)]

    async def send(self, conversation_id: ConversationId, turn: int,
                   messages: list[dict[str, str]]) -> RequestResult:
        return await self._pick(conversation_id, turn).send(conversation_id, turn, messages)

    async def send_body(self, conversation_id: ConversationId, turn: int, path: str,
                        body: dict[str, Any]) -> RequestResult:
        return await self._pick(conversation_id, turn).send_body(conversation_id, turn, path,
                                                                 body)


@dataclasses.dataclass
class PoolSession:
    """A BenchSession over several servers of one model: turns alternate between them, metrics
    are summed over them."""

    sessions: list[ServerSession]

    @property
    def model(self) -> str:
        return self.sessions[0].model

    @property
    def name(self) -> str:
        return " + ".join(session.name for session in self.sessions)

    @property
    def url(self) -> str:
        return " ".join(session.url for session in self.sessions)

    @property
    def vocab_size(self) -> None:
        return None

    async def scrape(self) -> Samples | None:
        scrapes = [await session.scrape() for session in self.sessions]
        if any(samples is None for samples in scrapes):
            return None
        total: Samples = {}
        for samples in scrapes:
            for key, value in samples.items():
                total[key] = total.get(key, 0.0) + value
        return total

    def client(self, output_tokens: int, clock_origin: float) -> AlternatingClient:
        return AlternatingClient([session.client(output_tokens, clock_origin)
                                  for session in self.sessions])


def offload_flag(config: PoolBenchConfig, name: str, store: str | None, run_id: str) -> list[str]:
    """The offload options of one configuration's servers; a shared store's chunks go under a
    prefix of this run."""
    if store is None:
        return ["--kv-offload", f"host={config.host_bytes}"]
    extra = parse_kv_offload(f"host={config.host_bytes},{store}")
    tier = extra["secondary_tiers"][0]
    if name == "redis":
        tier["key_prefix"] = f"shared-pool-{run_id}"
    else:
        tier["prefix"] = f"{tier.get('prefix', '')}/shared-pool-{run_id}".strip("/")
    return ["--kv-transfer-config", json.dumps({"kv_connector": "OffloadingConnector",
                                                "kv_connector_extra_config": extra})]


def server_command(config: PoolBenchConfig, port: int, offload: list[str]) -> list[str]:
    return [sys.executable, "-m", "kvtier.entrypoints.cli", "serve", "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "bfloat16",
            "--kv-cache-memory-bytes", str(config.device_kv_bytes),
            "--max-model-len", str(config.max_model_len), "--uvicorn-log-level", "warning",
            *offload]


@contextmanager
def shared_store(config: PoolBenchConfig, name: str) -> Iterator[str | None]:
    """The --kv-offload pair of the configuration's shared store (started here unless given);
    None for private host tiers."""
    if name == "private":
        yield None
        return
    given = config.redis_url if name == "redis" else config.s3_url
    with store_pair(f"{name}={given}" if given else name) as pair:
        yield pair


@contextmanager
def instances(config: PoolBenchConfig, name: str) -> Iterator[list[str]]:
    """The URLs of the configuration's servers, started and healthy, stopped on exit."""
    run_id = time.strftime("%Y%m%d-%H%M%S")
    with shared_store(config, name) as store, ExitStack() as stack:
        urls = []
        for index in range(NUM_INSTANCES):
            port = free_port()
            command = server_command(config, port, offload_flag(config, name, store, run_id))
            server = stack.enter_context(ServerProcess(
                command, dict(os.environ), port, config.log_dir / f"{name}-{index}.log",
                config.startup_timeout_s))
            print(f"<!-- {name} instance {index}: started in {server.startup_s:.0f} s -->",
                  flush=True)
            urls.append(server.url)
        yield urls


async def run_pool(config: PoolBenchConfig, name: str, urls: list[str]) -> dict:
    """A warm-up, then the measured run, through one alternating client."""
    targets = [ServerTarget(url=url, run_timeout_s=config.run_timeout_s) for url in urls]
    warmup = dataclasses.replace(config.workload, num_turns=2,
                                 seed=config.workload.seed + WARMUP_SEED_OFFSET)
    reports = []
    for workload, label in ((warmup, f"{name} warm-up"), (config.workload, name)):
        async with AsyncExitStack() as stack:
            sessions = [await stack.enter_async_context(
                open_server_session(target, workload.num_conversations)) for target in targets]
            reports.append(await run_multi_turn_on(PoolSession(sessions), workload, "chat",
                                                   config.run_timeout_s, label))
    return {"config": name, **reports[-1]}


def table_row(report: dict) -> str:
    hits = {tier: None if rates["hit_rate"] is None else round(rates["hit_rate"], 3)
            for tier, rates in report["hit_rates"].items()}
    ms = [("-" if report["ttft_s"][p] is None else f"{report['ttft_s'][p] * 1000:.0f}")
          for p in ("p50", "p90")]
    return (f"| {report['config']} | {report['input_tokens_per_s']:.0f} | "
            f"{report['output_tokens_per_s']:.1f} | {ms[0]} | {ms[1]} | {report['num_failed']} "
            f"| {json.dumps(hits)} |")


def run(config: PoolBenchConfig) -> list[dict]:
    print("| config | input tok/s | output tok/s | p50 TTFT ms | p90 TTFT ms | failed | hit rates "
          "|\n|---|---|---|---|---|---|---|", flush=True)
    reports = []
    for name in config.configs:
        with instances(config, name) as urls:
            reports.append(asyncio.run(run_pool(config, name, urls)))
        print(table_row(reports[-1]), flush=True)
        config.out_json.parent.mkdir(parents=True, exist_ok=True)
        config.out_json.write_text(json.dumps(reports, indent=2) + "\n")  # survive a later crash
    return reports


def parse_args(argv: list[str] | None = None) -> PoolBenchConfig:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--num-turns", type=int, default=4)
    p.add_argument("--system-prompt-tokens", type=int, default=128)
    p.add_argument("--context-tokens", type=int, default=2048,
                   help="each conversation's own context: what the other instance recomputes "
                        "without a shared pool")
    p.add_argument("--user-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--think-time", type=float, default=1.0,
                   help="seconds between a reply and the next turn (the stores of the reply's "
                        "KV reach the pool meanwhile)")
    p.add_argument("--start-interval", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device-kv-bytes", type=int, default=256 << 20,
                   help="each instance's device KV budget (SmolLM2 bf16: 23,040 B/token)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--host-bytes", type=int, default=2 << 30, help="each instance's host tier")
    p.add_argument("--redis-url", default=None, help="a Valkey/Redis server to share (default: "
                                                     "start one)")
    p.add_argument("--s3-url", default=None, help="s3://BUCKET/PREFIX to share, with the AWS "
                                                  "settings in the environment (default: start "
                                                  "a SeaweedFS)")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--run-timeout", type=float, default=7200.0)
    p.add_argument("--out-json", type=Path, default=Path("benchmarks/results/shared_pool.json"))
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/kvtier-shared-pool-logs"))
    a = p.parse_args(argv)
    workload = MultiTurnConfig(num_conversations=a.conversations, num_turns=a.num_turns,
                               system_prompt_tokens=a.system_prompt_tokens,
                               context_tokens=a.context_tokens, user_tokens=a.user_tokens,
                               output_tokens=a.output_tokens, think_time_s=a.think_time,
                               start_interval_s=a.start_interval, seed=a.seed)
    return PoolBenchConfig(configs=tuple(a.configs.split(",")), workload=workload,
                           device_kv_bytes=a.device_kv_bytes, max_model_len=a.max_model_len,
                           host_bytes=a.host_bytes, redis_url=a.redis_url, s3_url=a.s3_url,
                           startup_timeout_s=a.startup_timeout, run_timeout_s=a.run_timeout,
                           out_json=a.out_json, log_dir=a.log_dir)


if __name__ == "__main__":
    run(parse_args())
