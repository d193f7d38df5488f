"""What a server tells one client about others' prompts: `usage.prompt_tokens_details` (the
cached token count) only with --enable-prompt-tokens-details (without it: test_server.py), and
KV events without token ids when the events config says so. A real server process, raw HTTP and
a real ZMQ subscriber."""

from __future__ import annotations

import json
import time

import httpx
import msgpack
import zmq

from .server_process import ServerProcess, free_port

# 40 tokens: with 16-token blocks the second request finds 32 of them cached (the last token is
# always recomputed, so 2 whole blocks).
PROMPT = list(range(3, 43))
NUM_CACHED = 32
RECV_DEADLINE_MS = 10_000


def usages(server, model, headers=None):
    """The usage blocks of a completion and of a streamed one, both sent after the same prompt
    was served once."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": 2, "ignore_eos": True}
    url = f"{server.url}/v1/completions"
    httpx.post(url, json=body, headers=headers, timeout=60.0).raise_for_status()
    plain = httpx.post(url, json=body, headers=headers, timeout=60.0).json()["usage"]
    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url, json=stream_body, headers=headers, timeout=60.0) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: {")]
    return plain, json.loads(events[-1])["usage"]


def test_cached_tokens_with_the_flag_and_events_without_token_ids(tiny_model):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    events = {"enable_kv_cache_events": True, "endpoint": endpoint, "include_token_ids": False}
    proc = ServerProcess(tiny_model[0], "--block-size", "16", "--num-device-blocks", "64",
                         "--max-model-len", "256", "--enable-prompt-tokens-details",
                         "--kv-events-config", json.dumps(events))
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, RECV_DEADLINE_MS)
    sub.connect(endpoint)
    try:
        time.sleep(0.5)  # let the subscription reach the PUB socket
        plain, streamed = usages(proc, tiny_model[0])
        assert plain["prompt_tokens_details"] == {"cached_tokens": NUM_CACHED}
        assert streamed["prompt_tokens_details"] == {"cached_tokens": NUM_CACHED}
        stored = []
        while not stored:
            batch = msgpack.unpackb(sub.recv_multipart()[-1])
            stored = [event for event in batch[1] if event["type"] == "BlockStored"]
        # No token ids; block size as ever.
        assert stored[0]["token_ids"] == [] and stored[0]["block_size"] == 16
    finally:
        sub.close(linger=0)
        proc.stop()
