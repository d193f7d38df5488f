"""A server with one running slot, one waiting slot and a small device cache: 503 when full,
prompts the cache cannot hold refused at once, clients that leave while queued aborted,
graceful SIGTERM."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from .server_process import ServerProcess

# Long enough that the first request is still running while the test fills the queue.
LONG = 1000  # 64 blocks of 16 hold 1,008 tokens: the server lowers max_model_len to that
SHORT = 64
WAIT_DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def server(tiny_model):
    proc = ServerProcess(tiny_model[0], "--max-num-seqs", "1", "--max-waiting-requests", "1",
                         "--num-device-blocks", "64")
    yield proc
    proc.stop()


def _stream(url: str, prompt: list[int], max_tokens: int, result: dict,
            first_token: threading.Event, stop: threading.Event) -> None:
    """Read a streamed completion into result; leave early (disconnect) once stop is set."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "return_token_ids": True, "temperature": 0.0}
    tokens, finish = [], None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120.0) as response:
        for line in response.iter_lines():
            if stop.is_set():
                break
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[len("data: "):])["choices"][0]
            tokens += choice.get("token_ids", [])
            finish = choice.get("finish_reason") or finish
            first_token.set()
    result.update(status=response.status_code, tokens=tokens, finish=finish)


def _start(url: str, prompt: list[int], max_tokens: int, stop: threading.Event):
    result, first_token = {}, threading.Event()
    thread = threading.Thread(target=_stream, args=(url, prompt, max_tokens, result,
                                                    first_token, stop))
    thread.start()
    return thread, result, first_token


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10.0).text.splitlines():
        if line.partition(" ")[0].partition("{")[0] == name:  # labels: model_name, engine
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} missing from /metrics")


def _waiting(url: str) -> float:
    return _metric(url, "vllm:num_requests_waiting")


def test_full_waiting_queue_is_503_with_retry_after(server):
    stop = threading.Event()
    running, _, running_started = _start(server.url, [3, 4, 5], LONG, stop)
    try:
        assert running_started.wait(WAIT_DEADLINE_S)
        queued, _, _ = _start(server.url, [4, 4, 5], LONG, stop)
        deadline = time.monotonic() + WAIT_DEADLINE_S
        while _waiting(server.url) != 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        refused = httpx.post(f"{server.url}/v1/completions",
                             json={"prompt": [7], "max_tokens": 2}, timeout=30.0)
        assert running.is_alive()
    finally:
        stop.set()
    assert refused.status_code == 503
    assert refused.headers["retry-after"] == "1"
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("service_unavailable_error", "queue_full")
    for thread in (running, queued):
        thread.join(WAIT_DEADLINE_S)


def test_a_prompt_the_cache_cannot_hold_is_400_at_once(server):
    # Before: max_model_len stayed the model's 2,048; such a prompt was accepted, never
    # admitted, and every later request waited behind it until the output timeout.
    card = httpx.get(f"{server.url}/v1/models", timeout=10.0).json()["data"][0]
    assert card["max_model_len"] == 1008
    refused = httpx.post(f"{server.url}/v1/completions", timeout=30.0,
                         json={"prompt": [5] * 1100, "max_tokens": 1})
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "context_length_exceeded"
    served = httpx.post(f"{server.url}/v1/completions", timeout=30.0,
                        json={"prompt": [5, 6], "max_tokens": 2})
    assert served.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_leaving_while_queued_aborts_its_request(server, stream):
    # Before: the handler waited for the request's first output without watching the client,
    # so the request stayed queued after its client left, and ran once the slot was free.
    generated = _metric(server.url, "vllm:generation_tokens_total")
    stop = threading.Event()
    running, result, running_started = _start(server.url, [3, 4, 5], LONG, stop)
    assert running_started.wait(WAIT_DEADLINE_S)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", timeout=0.3,
                   json={"prompt": [4, 4, 5], "max_tokens": 4, "stream": stream})
    running.join(WAIT_DEADLINE_S)
    assert len(result["tokens"]) == LONG
    deadline = time.monotonic() + WAIT_DEADLINE_S
    while (_metric(server.url, "vllm:num_requests_running") or _waiting(server.url)) and \
            time.monotonic() < deadline:
        time.sleep(0.02)
    # Only the running request generated: the queued one was aborted, never admitted.
    assert _metric(server.url, "vllm:generation_tokens_total") - generated == LONG


def test_sigterm_finishes_in_flight_request(server):
    thread, result, first_token = _start(server.url, [9, 8, 7], SHORT, threading.Event())
    assert first_token.wait(WAIT_DEADLINE_S)
    # uvicorn re-raises the signal once shutdown is done, so the exit status says SIGTERM.
    assert server.terminate() == -signal.SIGTERM
    thread.join(WAIT_DEADLINE_S)
    assert (result["status"], len(result["tokens"]), result["finish"]) == \
        (200, SHORT, "length")
