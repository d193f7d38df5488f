"""Two `kvtier serve` processes share one store, a SeaweedFS bucket or one Valkey server, each with
a host tier of its own: each answers the prompts the other served from the store (its tier hit
counter and its cached-token counts say so), and every answer is HF transformers' greedy
continuation (fp32), the tokens of a run without offloading."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from ..entrypoints.server_process import ServerProcess
from ..stores import SeaweedS3, ValkeyServer
from ..tiny_models import hf_greedy, make_hf_model, random_prompts
from .completions import greedy_completion
from .test_restart_faults import STORE_DEADLINE_S, _metric

BLOCK = 16  # the server's default block size
# 4 loadable blocks each (the last token is always recomputed).
PROMPTS = random_prompts(4, 4 * BLOCK + 5, seed=25)
LOADABLE = 4 * BLOCK
# Stored per prompt: its 4 full blocks (69 + 6 tokens, the last not computed: 74).
CHUNK_BYTES = 2 * 2 * BLOCK * 2 * 16 * 4  # layers * (K, V) * block * kv heads * head dim * fp32
STORED_BYTES = 4 * CHUNK_BYTES
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("shared_store_model")
    hf = make_hf_model("llama", directory, tokenizer="bytes")
    return str(directory), hf_greedy(hf, PROMPTS, MAX_TOKENS)


@pytest.fixture
def store_flag(request, tmp_path, monkeypatch):
    """The --kv-offload part that names the shared store, the store running."""
    if request.param == "obj":
        with SeaweedS3(tmp_path) as s3:
            s3.create_bucket("kv-cache")
            for name, value in s3.env().items():  # the servers inherit the AWS settings
                monkeypatch.setenv(name, value)
            yield "obj=s3://kv-cache/shared"
    else:
        with ValkeyServer(tmp_path) as valkey:
            yield f"redis={valkey.url}"


def _complete(url: str, prompt: list[int]) -> tuple[list[int], int]:
    return greedy_completion(url, prompt, MAX_TOKENS)


def _wait_stored(url: str, tier: str, num_bytes: float) -> None:
    """Until `num_bytes` have gone to the tier. Stores end on the tier's threads and are counted
    at the next engine step, which an idle engine does not take: a one-token request (too short
    to fill a block, so it stores nothing) gives it one."""
    deadline = time.monotonic() + STORE_DEADLINE_S
    while _metric(url, "kvtier:offload_bytes", direction=f"host_to_{tier}") < num_bytes:
        assert time.monotonic() < deadline, f"stores to the {tier} tier hang"
        httpx.post(f"{url}/v1/completions", timeout=120,
                   json={"prompt": [5], "max_tokens": 1}).raise_for_status()
        time.sleep(0.1)


@pytest.mark.parametrize("store_flag", ["obj", "redis"], indirect=True)
def test_two_servers_share_one_store(model, store_flag):
    model_dir, expected = model
    tier = store_flag.split("=")[0]
    args = ("--kv-offload", f"host=64MiB,{store_flag}", "--enable-prompt-tokens-details")
    with ThreadPoolExecutor(2) as pool:  # both start at once: half the wait
        starts = [pool.submit(ServerProcess, model_dir, *args) for _ in range(2)]
        servers = [start.result() for start in starts]
    first, second = servers
    try:
        assert [_complete(first.url, p) for p in PROMPTS[:3]] == [(e, 0) for e in expected[:3]]
        _wait_stored(first.url, tier, 3 * STORED_BYTES)
        assert [_complete(second.url, p) for p in PROMPTS[:3]] == [
            (e, LOADABLE) for e in expected[:3]]
        assert _metric(second.url, "kvtier:offload_tier_hits", tier=tier) == 3 * LOADABLE / BLOCK
        # And the other way: what the second computed, the first loads.
        assert _complete(second.url, PROMPTS[3]) == (expected[3], 0)
        _wait_stored(second.url, tier, STORED_BYTES)
        assert _complete(first.url, PROMPTS[3]) == (expected[3], LOADABLE)
        assert _metric(first.url, "kvtier:offload_tier_hits", tier=tier) == LOADABLE / BLOCK
        for server in servers:
            assert _metric(server.url, "kvtier:offload_tier_errors", tier=tier) == 0
    finally:
        for server in servers:
            server.stop()
