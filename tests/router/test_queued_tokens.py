"""The prefill work the router counts at an instance: a request's uncached prompt tokens from
when it is sent until its first token comes back (or its answer, or its failure).

The instance is a scripted HTTP app on a real socket: a real `kvtier serve` cannot be made to
hold its first token until the test lets it go."""

from __future__ import annotations

import asyncio
import threading
import time

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse

from kvtier.router.config import RouterConfig
from kvtier.router.prompts import COMPLETIONS_PATH, PromptHasher, load_tokenizer
from kvtier.router.service import RouterService

from ..entrypoints.server_process import free_port
from ..tiny_models import save_byte_tokenizer
from .asgi_client import run_scenario

WAIT_S = 10.0
PROMPT = "a prompt of several blocks, one token a byte, nothing of it cached anywhere yet"


def scripted_instance(first_token: threading.Event, rest: threading.Event) -> FastAPI:
    """Streams one token when `first_token` is set and ends when `rest` is; a request without
    "stream" gets a 400, as a bad body would."""
    app = FastAPI()

    async def stream():
        await asyncio.to_thread(first_token.wait, WAIT_S)
        yield 'data: {"choices": [{"index": 0, "text": "x"}]}\n\n'
        await asyncio.to_thread(rest.wait, WAIT_S)
        yield "data: [DONE]\n\n"

    @app.post(COMPLETIONS_PATH)
    async def completions(body: dict):
        if not body.get("stream"):
            return JSONResponse({"error": {"message": "bad"}}, status_code=400)
        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


async def until(condition) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)


def test_a_request_counts_as_queued_prefill_until_its_first_token(tmp_path):
    save_byte_tokenizer(tmp_path)
    first_token, rest = threading.Event(), threading.Event()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(scripted_instance(first_token, rest), port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    service = RouterService(RouterConfig(instances=(f"http://127.0.0.1:{port}",)))
    service.hasher = PromptHasher(load_tokenizer(str(tmp_path)), 16, "sha256_cbor")
    instance = service.instances[0]
    instance.healthy = True
    body = {"prompt": PROMPT, "max_tokens": 1, "stream": True}
    num_tokens = len(service.hasher.token_ids(COMPLETIONS_PATH, body))

    async def scenario(service, client) -> None:
        await until(lambda: server.started)
        request = asyncio.create_task(client.post(COMPLETIONS_PATH, json=body))
        await until(lambda: instance.in_flight == 1)
        assert instance.queued_tokens == num_tokens > 16
        metrics = service.metrics.render().decode()
        assert f'instance_queued_tokens{{instance="{instance.url}"}} {num_tokens}.0' in metrics
        # The same prompt again would wait behind it: queued + 64 a request of load + its own.
        explained = (await client.post("/router/explain", json={
            "path": COMPLETIONS_PATH, "body": body})).json()
        assert explained["prefill_tokens"] == num_tokens
        assert explained["instances"][0]["cost_tokens"] == 2 * num_tokens + 64
        first_token.set()
        # Its prompt is computed: the request still decodes, but waits ahead of nobody.
        await until(lambda: instance.queued_tokens == 0)
        assert instance.in_flight == 1
        rest.set()
        response = await request
        assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n")
        assert (instance.in_flight, instance.queued_tokens) == (0, 0)
        failed = await client.post(COMPLETIONS_PATH, json={**body, "stream": False})
        assert failed.status_code == 400
        assert (instance.in_flight, instance.queued_tokens) == (0, 0)

    try:
        asyncio.run(run_scenario(service, scenario))
    finally:
        first_token.set()
        rest.set()
        server.should_exit = True
        thread.join(WAIT_S)
