"""Real P/D processes for tests: `kvtier serve` instances with the P2PConnector as producer or
consumer over loopback, a `kvtier router --prefill --decode` in front, and what the tests ask
of them (greedy completions, metric samples, the wait until nothing is held)."""

from __future__ import annotations

import json
import time

import httpx

from .conftest import RouterProcess

BLOCK_SIZE = 4
MAX_TOKENS = 6
TIMEOUT_S = 120.0
# Sends end within a step or two of the decode instance's load; bounds it on a busy machine.
IDLE_DEADLINE_S = 15.0
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
          "return_token_ids": True}


def serve_args(role: str, load_timeout_s: float = 10.0, **extra) -> list[str]:
    """`kvtier serve` flags of a P2PConnector `role`; `extra`: its extra config."""
    config = {"kv_connector": "P2PConnector", "kv_role": role,
              "kv_load_timeout_s": load_timeout_s, "kv_connector_extra_config": extra}
    return ["--block-size", str(BLOCK_SIZE), "--num-device-blocks", "64",
            "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(config)]


def pd_ready(state: dict) -> bool:
    return all(i["healthy"] for i in state["instances"]) and \
        any(i["transport_address"] for i in state["instances"])


def start_pd_router(log_dir: str, prefill_url: str, decode_url: str) -> RouterProcess:
    return RouterProcess(log_dir, [], "--prefill", prefill_url, "--decode", decode_url,
                         "--prefill-timeout", "30", ready=pd_ready)


def metric(url: str, series: str) -> float:
    """The sum of a series' samples (a counter's name with or without _total; labels given
    select one sample)."""
    name, brace, labels = series.partition("{")
    names = (name, f"{name}_total")
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=5.0).text.splitlines():
        key, _, value = line.rpartition(" ")
        wanted = key in {n + brace + labels for n in names} if labels \
            else key.partition("{")[0] in names
        if wanted and not line.startswith("#"):
            total += float(value)
    return total


def complete(url: str, prompt: list[int]) -> dict:
    response = httpx.post(f"{url}/v1/completions", timeout=TIMEOUT_S,
                          json={"prompt": prompt, **GREEDY})
    assert response.status_code == 200, response.text
    return response.json()


def token_ids(results: list[dict]) -> list[list[int]]:
    return [r["choices"][0]["token_ids"] for r in results]


def wait_until_idle(url: str, deadline_s: float = IDLE_DEADLINE_S) -> None:
    """Until the instance holds no KV block and has no request running or waiting (a
    producer's blocks stay held until their send ends; a consumer's request waits for its
    load)."""
    gauges = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running",
              "vllm:num_requests_waiting")
    deadline = time.monotonic() + deadline_s
    while any(metric(url, gauge) != 0 for gauge in gauges):
        assert time.monotonic() < deadline, f"{url} still holds KV blocks or requests"
        time.sleep(0.1)


def loaded_tokens(prompt: list[int]) -> int:
    """Prompt tokens the decode instance takes from the prefill: every full block before the
    last token (the one it computes to sample)."""
    return (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
