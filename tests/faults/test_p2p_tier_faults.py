"""Two `kvtier serve` processes, A serving its host tier (`p2p_listen`) and B asking it (`p2p`):
B answers a prompt A computed from A's host memory (B's p2p hits and cached tokens say so), and
when A is paused, killed, or computes KV of another namespace, B recomputes: every answer is HF
transformers' greedy continuation (fp32), never late past the tier's deadlines."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from ..entrypoints.server_process import ServerProcess, free_port
from ..tiny_models import hf_greedy, make_hf_model, random_prompts
from .completions import greedy_completion
from .test_restart_faults import STORE_DEADLINE_S, _metric

BLOCK = 16  # the server's default block size
# 4 loadable blocks each (the last token is always recomputed).
PROMPTS = random_prompts(5, 4 * BLOCK + 5, seed=26)
LOADABLE = 4 * BLOCK
CHUNK_BYTES = 2 * 2 * BLOCK * 2 * 16 * 4  # layers * (K, V) * block * kv heads * head dim * fp32
MAX_TOKENS = 6
# B's p2p options in the flag form use the tier's defaults: a request to a peer waits 2 s.
SLOW_PEER_S = 15.0


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("p2p_tier_model")
    hf = make_hf_model("llama", directory, tokenizer="bytes")
    return str(directory), hf_greedy(hf, PROMPTS, MAX_TOKENS)


def _start_pair(model_dir: str, port: int, *a_args: str) -> list[ServerProcess]:
    """A listening on `port`, B asking it; both start at once (half the wait)."""
    flags = [("--kv-offload", f"host=64MiB,p2p_listen=127.0.0.1:{port}", *a_args),
             ("--kv-offload", f"host=64MiB,p2p=127.0.0.1:{port}")]
    with ThreadPoolExecutor(2) as pool:
        starts = [pool.submit(ServerProcess, model_dir, *flag, "--enable-prompt-tokens-details")
                  for flag in flags]
        return [start.result() for start in starts]


@pytest.fixture(scope="module")
def pair(model):
    """(A, B, expected tokens), shared by the tests that use distinct prompts (the last one
    kills A)."""
    model_dir, expected = model
    servers = _start_pair(model_dir, free_port())
    try:
        yield servers[0], servers[1], expected
    finally:
        for server in servers:
            if server.process.poll() is None:
                os.kill(server.process.pid, signal.SIGCONT)  # a paused one must see SIGTERM
            server.stop()


def _complete(url: str, prompt: list[int]) -> tuple[list[int], int]:
    return greedy_completion(url, prompt, MAX_TOKENS)


def _wait_in_host(url: str, num_bytes: float) -> None:
    """Until `num_bytes` have reached A's host tier. A device->host copy is collected at the
    next engine step, which an idle engine does not take: a one-token request gives it one."""
    deadline = time.monotonic() + STORE_DEADLINE_S
    while _metric(url, "kvtier:offload_bytes", direction="device_to_host") < num_bytes:
        assert time.monotonic() < deadline, "stores to host memory hang"
        httpx.post(f"{url}/v1/completions", timeout=120,
                   json={"prompt": [5], "max_tokens": 1}).raise_for_status()
        time.sleep(0.1)


def test_b_serves_what_a_computed_from_a_host_memory(pair):
    a, b, expected = pair
    assert [_complete(a.url, p) for p in PROMPTS[:2]] == [(e, 0) for e in expected[:2]]
    _wait_in_host(a.url, 2 * 4 * CHUNK_BYTES)
    assert [_complete(b.url, p) for p in PROMPTS[:2]] == [(e, LOADABLE) for e in expected[:2]]
    assert _metric(b.url, "kvtier:offload_tier_hits", tier="p2p") == 2 * LOADABLE / BLOCK
    assert _metric(b.url, "kvtier:offload_bytes", direction="p2p_to_host") == 8 * CHUNK_BYTES
    assert _metric(b.url, "kvtier:offload_tier_errors", tier="p2p") == 0
    # A prompt neither computed: a miss on both, computed by B.
    assert _complete(b.url, PROMPTS[2]) == (expected[2], 0)


def test_a_paused_then_killed_peer_costs_recomputes_not_hangs(pair):
    a, b, expected = pair
    in_host = _metric(a.url, "kvtier:offload_bytes", direction="device_to_host")
    assert _complete(a.url, PROMPTS[3]) == (expected[3], 0)
    _wait_in_host(a.url, in_host + 4 * CHUNK_BYTES)
    os.kill(a.process.pid, signal.SIGSTOP)  # a peer that stops answering mid-conversation
    start = time.monotonic()
    assert _complete(b.url, PROMPTS[3]) == (expected[3], 0)
    assert time.monotonic() - start < SLOW_PEER_S
    assert _metric(b.url, "kvtier:offload_store_request_errors", tier="p2p") >= 1
    os.kill(a.process.pid, signal.SIGKILL)
    a.process.wait(30)
    assert _complete(b.url, PROMPTS[4]) == (expected[4], 0)
    assert _complete(b.url, PROMPTS[3]) == (expected[3], LOADABLE)  # B's own host tier now


def test_a_peer_with_another_namespace_is_refused_and_counted(model):
    model_dir, expected = model
    # Another block size: KV of another layout, so another namespace.
    a, b = _start_pair(model_dir, free_port(), "--block-size", "8")
    try:
        httpx.post(f"{a.url}/v1/completions", timeout=120,
                   json={"prompt": PROMPTS[0], "max_tokens": 1}).raise_for_status()
        assert _complete(b.url, PROMPTS[0]) == (expected[0], 0)
        assert _metric(b.url, "kvtier:offload_p2p_refused", tier="p2p", code="namespace") >= 1
    finally:
        a.stop()
        b.stop()
