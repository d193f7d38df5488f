"""A tiny OpenAI-compatible streaming server, run in-process, for the benchmark client's tests.

It answers every request with `max_tokens` words ("w0 w1 ..."), one SSE chunk each, after
FIRST_TOKEN_DELAY_S and then TOKEN_INTERVAL_S per token, reports usage with prompt tokens = the
number of words in the prompt, and exposes Prometheus counters that grow by fixed amounts per
request, so the tests can predict every count the benchmark reports.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

FIRST_TOKEN_DELAY_S = 0.05
TOKEN_INTERVAL_S = 0.01
MODEL_NAME = "fake-model"
# Counter values before any request, so the tests see that the benchmark reports differences.
INITIAL_COUNTERS = {"device_hits": 100.0, "device_queries": 1000.0, "host_hits": 7.0,
                    "host_queries": 9.0, "disk_hits": 0.0, "disk_queries": 3.0}
# How much each request adds to each counter.
PER_REQUEST = {"device_hits": 2.0, "device_queries": 10.0, "host_hits": 3.0,
               "host_queries": 4.0, "disk_hits": 1.0, "disk_queries": 4.0}


class FakeOpenAIServer:
    """Records every request body; requests whose index is in `fail_on_request_index` get a 500,
    those in `error_in_stream_on_request_index` a 200 stream that ends in an error event."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.arrival_times: list[float] = []
        self.metrics_enabled = True
        self.counters = dict(INITIAL_COUNTERS)
        self.fail_on_request_index: set[int] = set()
        self.error_in_stream_on_request_index: set[int] = set()
        self.app = self._build_app()
        self.base_url = ""
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def _build_app(self) -> FastAPI:
        app = FastAPI()
        app.get("/v1/models")(self._models)
        app.get("/metrics")(self._metrics)
        app.post("/v1/chat/completions")(self._chat)
        app.post("/v1/completions")(self._completions)
        return app

    async def _models(self) -> dict:
        return {"object": "list", "data": [{"id": MODEL_NAME, "object": "model"}]}

    async def _metrics(self) -> PlainTextResponse:
        if not self.metrics_enabled:
            return PlainTextResponse("not found", status_code=404)
        c = self.counters
        lines = [
            "# TYPE vllm:prefix_cache_hits counter",
            f'vllm:prefix_cache_hits_total{{model_name="{MODEL_NAME}"}} {c["device_hits"]}',
            "# TYPE vllm:prefix_cache_queries counter",
            f'vllm:prefix_cache_queries_total{{model_name="{MODEL_NAME}"}} {c["device_queries"]}',
            "# TYPE kvtier:offload_tier_hits counter",
            f'kvtier:offload_tier_hits_total{{tier="host"}} {c["host_hits"]}',
            f'kvtier:offload_tier_hits_total{{tier="disk"}} {c["disk_hits"]}',
            "# TYPE kvtier:offload_tier_queries counter",
            f'kvtier:offload_tier_queries_total{{tier="host"}} {c["host_queries"]}',
            f'kvtier:offload_tier_queries_total{{tier="disk"}} {c["disk_queries"]}',
        ]
        return PlainTextResponse("\n".join(lines) + "\n")

    async def _chat(self, request: Request):
        body = await request.json()
        words = sum(len(m["content"].split()) for m in body["messages"])
        return self._respond(body, words, chat=True)

    async def _completions(self, request: Request):
        body = await request.json()
        return self._respond(body, len(body["prompt"].split()), chat=False)

    def _respond(self, body: dict, num_prompt_tokens: int, chat: bool):
        index = len(self.requests)
        self.requests.append(body)
        self.arrival_times.append(time.monotonic())
        if index in self.fail_on_request_index:
            return JSONResponse({"error": "injected failure"}, status_code=500)
        for name, step in PER_REQUEST.items():
            self.counters[name] += step
        chunks = _sse_chunks(body["max_tokens"], num_prompt_tokens, chat,
                             fail_mid_stream=index in self.error_in_stream_on_request_index)
        return StreamingResponse(chunks, media_type="text/event-stream")

    def start(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10.0
        while not self._server.started:
            if time.monotonic() > deadline:
                raise TimeoutError("fake OpenAI server did not start within 10 s")
            time.sleep(0.01)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10.0)
        if self._thread.is_alive():
            raise TimeoutError("fake OpenAI server did not stop within 10 s")


async def _sse_chunks(max_tokens: int, num_prompt_tokens: int, chat: bool,
                      fail_mid_stream: bool = False):
    if chat:
        # vLLM opens a chat stream with an empty, role-only delta; TTFT must not count it.
        yield _event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    await asyncio.sleep(FIRST_TOKEN_DELAY_S)
    for i in range(max_tokens):
        if i > 0:
            await asyncio.sleep(TOKEN_INTERVAL_S)
        piece = f" w{i}"
        choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
        yield _event({"choices": [choice]})
        if fail_mid_stream:
            # How vLLM and kvtier report a failure once the 200 stream has started.
            yield _event({"error": {"message": "engine step failed", "type": "internal_error",
                                    "param": None, "code": "engine_step_failed"}})
            yield "data: [DONE]\n\n"
            return
    usage = {"prompt_tokens": num_prompt_tokens, "completion_tokens": max_tokens,
             "total_tokens": num_prompt_tokens + max_tokens}
    yield _event({"choices": [], "usage": usage})
    yield "data: [DONE]\n\n"


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
