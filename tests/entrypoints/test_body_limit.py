"""BodyLimitMiddleware over a chunked body (no Content-Length), driven as ASGI in-process, and
the --max-request-body-bytes flag's checks."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvtier.entrypoints.cli import main
from kvtier.entrypoints.openai.body_limit import BodyLimitMiddleware

SCOPE = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}


def serve(chunks: list[bytes], max_bytes: int) -> tuple[list[dict], list[bytes], int]:
    """(messages the middleware sent, bodies the app read, messages taken from the client)."""
    incoming = [{"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1}
                for i, chunk in enumerate(chunks)] + [{"type": "http.disconnect"}]
    taken, sent, bodies = [0], [], []

    async def receive() -> dict:
        taken[0] += 1
        return incoming[taken[0] - 1]

    async def send(message: dict) -> None:
        sent.append(message)

    async def app(scope, app_receive, app_send) -> None:
        message = await app_receive()
        bodies.append(message["body"])
        assert not message["more_body"]
        assert (await app_receive())["type"] == "http.disconnect"
        await app_send({"type": "http.response.start", "status": 200, "headers": []})
        await app_send({"type": "http.response.body", "body": b"ok"})

    asyncio.run(BodyLimitMiddleware(app, max_bytes)(SCOPE, receive, send))
    return sent, bodies, taken[0]


def test_a_chunked_body_within_the_limit_reaches_the_app_whole():
    sent, bodies, _ = serve([b'{"prompt": ', b'"x"}'], max_bytes=15)
    assert bodies == [b'{"prompt": "x"}']
    assert sent[0]["status"] == 200


def test_a_chunked_body_past_the_limit_is_413_and_read_no_further():
    sent, bodies, taken = serve([b"a" * 10, b"b" * 10, b"c" * 10], max_bytes=15)
    assert bodies == []  # the app never ran
    assert taken == 2  # the third chunk was never read
    assert sent[0]["status"] == 413
    error = json.loads(sent[1]["body"])["error"]
    assert error["code"] == "request_too_large"
    assert "limit of 15 bytes" in error["message"]


@pytest.mark.parametrize("value, message", [
    ("0", "--max-request-body-bytes must be > 0, got 0"),
    ("lots", "--max-request-body-bytes must be a byte size such as 4GiB, 512MiB or "
             "1073741824, got 'lots'"),
])
def test_a_bad_limit_is_a_one_line_error(value, message, capsys):
    assert main(["serve", "--max-request-body-bytes", value]) != 0
    assert capsys.readouterr().err.strip() == f"kvtier serve: error: {message}"
