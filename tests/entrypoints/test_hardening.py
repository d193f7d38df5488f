"""Requests that used to hurt other clients, against the real server process: each is refused
alone with a 400 / 413 naming the problem, and everyone else is served as before."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time

import httpx
import pytest

from .server_process import ServerProcess

GREEDY = {"temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
# Generous on a shared 2-core machine: before, /health waited out the whole tokenization (~8 s).
HEALTH_BOUND_S = 2.0
OUT_OF_VOCAB = 1_000_000_000


@pytest.fixture(scope="module")
def server(tiny_model):
    proc = ServerProcess(tiny_model[0], "--num-device-blocks", "128", "--max-model-len", "512")
    yield proc
    proc.stop()


def post(server, path: str, body=None, **options) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60.0, **options)


def assert_400(response: httpx.Response, param: str | None, message: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert message in error["message"]


def test_an_out_of_vocabulary_stop_token_id_is_refused_alone(server):
    # Before: an IndexError in the sampler failed the engine step: all 8 requests got 500.
    prompts = [[20 + i, 30 + i, 40] for i in range(8)]
    alone = [post(server, "/v1/completions", {"prompt": p, "max_tokens": 5, **GREEDY})
             .json()["choices"][0]["token_ids"] for p in prompts]
    bad = {"min_tokens": 2, "stop_token_ids": [OUT_OF_VOCAB]}

    async def run_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60.0) as client:
            return await asyncio.gather(*(client.post(
                f"{server.url}/v1/completions",
                json={"prompt": p, "max_tokens": 5, **GREEDY, **(bad if i == 3 else {})})
                for i, p in enumerate(prompts)))

    responses = asyncio.run(run_all())
    assert_400(responses[3], "stop_token_ids", "token id 1000000000, outside the vocabulary")
    for i, response in enumerate(responses):
        if i != 3:
            assert response.json()["choices"][0]["token_ids"] == alone[i]


def test_health_answers_while_a_long_prompt_is_tokenized(server):
    # ~3 MB of text: seconds of tokenizing, then a 400 for the context length.
    body = json.dumps({"prompt": "ab " * 1_000_000, "max_tokens": 1}).encode()
    result: dict = {}
    sender = threading.Thread(target=lambda: result.update(response=httpx.post(
        f"{server.url}/v1/completions", content=body, timeout=120.0,
        headers={"Content-Type": "application/json"})))
    sender.start()
    latencies = []
    while sender.is_alive():
        started = time.monotonic()
        assert httpx.get(f"{server.url}/health", timeout=60.0).status_code == 200
        latencies.append(time.monotonic() - started)
        time.sleep(0.1)
    sender.join()
    assert_400(result["response"], "prompt", "maximum context length is 512 tokens")
    assert len(latencies) >= 3, latencies  # it was polled while the prompt was processed
    assert max(latencies) < HEALTH_BOUND_S, latencies


def _raw_request(server, head: str, body: bytes = b"") -> bytes:
    with socket.create_connection(("127.0.0.1", server.port), timeout=30.0) as sock:
        sock.sendall(head.encode() + b"\r\n" + body)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def test_an_oversized_body_is_413_before_it_is_read(server):
    # Only the headers are sent: the answer cannot come from parsing the 9 MiB body.
    head = ("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {9 * 1024 * 1024}\r\n")
    reply = _raw_request(server, head)
    status, _, rest = reply.partition(b"\r\n")
    assert status == b"HTTP/1.1 413 Request Entity Too Large"
    error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == "request_too_large"
    assert "8388608 bytes (--max-request-body-bytes)" in error["message"]


@pytest.mark.parametrize("path, raw, param", [
    ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "a\\udfffb"], "max_tokens": 2}', "prompt[1]"),
    ("/v1/completions", '{"prompt": "ok", "stop": ["\\ud800"], "max_tokens": 2}', "stop[0]"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
     "messages[0].content"),
])
def test_a_lone_surrogate_is_400_and_the_connection_stays_open(server, path, raw, param):
    # Before: 500, and the keep-alive connection was dropped.
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60.0)
    headers = {"Content-Type": "application/json"}
    try:
        connection.request("POST", path, raw.encode(), headers)
        response = connection.getresponse()
        error = json.loads(response.read())["error"]
        assert (response.status, error["param"]) == (400, param)
        assert "not valid Unicode" in error["message"]
        sock = connection.sock
        connection.request("POST", "/v1/completions", b'{"prompt": [5, 6], "max_tokens": 2}',
                           headers)
        assert connection.getresponse().status == 200
        assert connection.sock is sock  # the same connection served the next request
    finally:
        connection.close()


@pytest.mark.parametrize("content", [b"", b"null", b"[1]", b"7", b'"x"'])
def test_a_body_that_is_not_an_object_says_so(server, content):
    # Before: an empty body was "missing required field 'None'".
    response = httpx.post(f"{server.url}/v1/completions", content=content, timeout=30.0,
                          headers={"Content-Type": "application/json"})
    assert_400(response, None, "request body must be a JSON object")


@pytest.mark.parametrize("extra, param", [
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stream": "yes"}, "stream"),
    ({"echo": 1}, "echo"),
])
def test_values_that_used_to_be_accepted_are_400(server, extra, param):
    response = post(server, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2, **extra})
    assert_400(response, param, "")


def test_a_duplicate_request_id_is_served_without_revealing_the_live_one(server):
    # Before: while one request with the id was live, the others got 400 "request id
    # 'cmpl-same' is already in use".
    body = {"prompt": [7, 8, 9], "max_tokens": 64, **GREEDY}

    async def run_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60.0) as client:
            return await asyncio.gather(*(
                client.post(f"{server.url}/v1/completions", json=body,
                            headers={"X-Request-Id": "same"}) for _ in range(8)))

    responses = asyncio.run(run_all())
    assert [r.status_code for r in responses] == [200] * 8, responses[-1].text
    assert {(r.json()["id"], r.headers["x-request-id"]) for r in responses} == {
        ("cmpl-same", "same")}
    assert len({tuple(r.json()["choices"][0]["token_ids"]) for r in responses}) == 1
