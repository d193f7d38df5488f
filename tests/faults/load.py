"""A mixed client load for the load and soak tests: streams and plain requests, chat and
completions, n > 1, long prompts, clients that leave mid-stream, invalid requests. Every
request loop is bounded in count and time; traffic goes to 127.0.0.1 only."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import httpx

from kvtier.entrypoints.bench.metrics_scrape import parse_samples

REQUEST_TIMEOUT_S = float(__import__("os").environ.get("KVTIER_LOAD_TIMEOUT_S", "120"))
# How long the server may take to settle (every request finished, every block freed).
SETTLE_DEADLINE_S = 60.0


@dataclass
class LoadResult:
    statuses: dict[int, int] = field(default_factory=dict)
    num_disconnects: int = 0

    def count(self, status: int) -> None:
        self.statuses[status] = self.statuses.get(status, 0) + 1


def _body(rng: random.Random) -> tuple[str, dict]:
    words = " ".join(rng.choice(("kv", "cache", "tier", "host", "disk", "block"))
                     for _ in range(rng.choice((4, 40, 400))))
    kind = rng.choice(("completion", "chat", "n2", "invalid"))
    if kind == "chat":
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": words}],
                                        "max_tokens": rng.randint(1, 24)}
    if kind == "invalid":
        return "/v1/completions", {"prompt": words, "max_tokens": -3}
    body = {"prompt": words, "max_tokens": rng.randint(1, 24), "temperature": 0.7,
            "seed": rng.randint(0, 99)}
    if kind == "n2":
        body["n"] = 2
    return "/v1/completions", body


async def _one_request(http: httpx.AsyncClient, url: str, rng: random.Random,
                       result: LoadResult) -> None:
    path, body = _body(rng)
    leave_early = rng.random() < 0.2
    body["stream"] = leave_early or rng.random() < 0.5
    async with http.stream("POST", f"{url}{path}", json=body) as response:
        result.count(response.status_code)
        async for _ in response.aiter_lines():
            if leave_early:  # the client disconnects after the first line
                result.num_disconnects += 1
                break


async def run_load(url: str, num_clients: int, requests_per_client: int, seed: int) -> LoadResult:
    """`num_clients` concurrent clients, each sending `requests_per_client` requests in turn."""
    result = LoadResult()
    limits = httpx.Limits(max_connections=num_clients)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as http:
        async def client(index: int) -> None:
            rng = random.Random(seed * 1000 + index)
            for _ in range(requests_per_client):
                await _one_request(http, url, rng, result)
        await asyncio.gather(*(client(i) for i in range(num_clients)))
    return result


def gauges(url: str) -> dict[str, float]:
    samples = parse_samples(httpx.get(f"{url}/metrics", timeout=30).text)
    wanted = ("vllm:num_requests_running", "vllm:num_requests_waiting",
              "vllm:kv_cache_usage_perc")
    return {name: sum(v for (n, _), v in samples.items() if n == name) for name in wanted}


async def settled(url: str) -> dict[str, float]:
    """The server's gauges once no request runs or waits and no block is held (or at the
    deadline, whatever they are then)."""
    deadline = asyncio.get_running_loop().time() + SETTLE_DEADLINE_S
    while True:
        values = gauges(url)
        if not any(values.values()) or asyncio.get_running_loop().time() > deadline:
            return values
        await asyncio.sleep(0.5)
