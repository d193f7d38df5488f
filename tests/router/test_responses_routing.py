"""The Responses API through the router, two real instances: a response that goes on from a
stored one goes to the instance that stores it (the policy, round robin here, would send it to
the other), and so do the GET and DELETE of one, also for a router that did not relay it."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvtier.router.proxy import INSTANCE_HEADER

from ..entrypoints.server_process import ServerProcess
from .conftest import RouterProcess, instance_args

TIMEOUT_S = 120.0
# Events reach the router within milliseconds; this bounds the wait on a loaded machine.
EVENT_DEADLINE_S = 10.0


@pytest.fixture(scope="module")
def cluster(router_model):
    with ThreadPoolExecutor(2) as pool:
        starts = [pool.submit(ServerProcess, router_model, *instance_args()) for _ in range(2)]
        instances = [start.result() for start in starts]
    routers = []
    try:
        urls = [i.url for i in instances]
        routers.append(RouterProcess(router_model, urls, "--policy", "round-robin"))
        routers.append(RouterProcess(router_model, urls))  # kv-aware
        yield routers, instances
    finally:
        for router in routers:
            router.stop()
        for instance in instances:
            instance.stop()


def respond(url: str, model: str, **fields) -> httpx.Response:
    response = httpx.post(f"{url}/v1/responses", timeout=TIMEOUT_S, json={
        "model": model, "max_output_tokens": 4, "temperature": 0, **fields})
    assert response.status_code == 200, response.text
    return response


def test_a_conversation_stays_on_the_instance_that_stores_it(cluster, router_model):
    (router, _), _ = cluster
    first = respond(router.url, router_model, input="Hello")
    owner = first.headers[INSTANCE_HEADER]
    previous = first.json()["id"]
    for turn in range(3):  # round robin alone would alternate
        answer = respond(router.url, router_model, input=f"Turn {turn}",
                         previous_response_id=previous)
        assert answer.headers[INSTANCE_HEADER] == owner
        previous = answer.json()["id"]


def test_a_streamed_response_is_found_where_it_streamed_from(cluster, router_model):
    (router, _), _ = cluster
    with httpx.stream("POST", f"{router.url}/v1/responses", timeout=TIMEOUT_S, json={
            "model": router_model, "input": "Stream", "max_output_tokens": 4,
            "temperature": 0, "stream": True}) as response:
        owner = response.headers[INSTANCE_HEADER]
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ")]
    response_id = events[-1]["response"]["id"]
    for _ in range(2):
        answer = respond(router.url, router_model, input="Again",
                         previous_response_id=response_id)
        assert answer.headers[INSTANCE_HEADER] == owner


def test_stored_responses_are_read_and_deleted_where_they_live(cluster, router_model):
    (router, other), _ = cluster
    made = respond(router.url, router_model, input="Keep me").json()
    # The other router has relayed nothing: it looks for the response on the instances.
    for url in (router.url, other.url):
        got = httpx.get(f"{url}/v1/responses/{made['id']}", timeout=TIMEOUT_S)
        assert got.status_code == 200 and got.json() == made
    items = httpx.get(f"{other.url}/v1/responses/{made['id']}/input_items",
                      timeout=TIMEOUT_S).json()
    assert items["data"][0]["content"] == [{"type": "input_text", "text": "Keep me"}]
    answer = respond(other.url, router_model, input="On", previous_response_id=made["id"])
    assert answer.json()["previous_response_id"] == made["id"]
    deleted = httpx.delete(f"{other.url}/v1/responses/{made['id']}", timeout=TIMEOUT_S)
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    missing = httpx.get(f"{router.url}/v1/responses/{made['id']}", timeout=TIMEOUT_S)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "response_id"


def test_a_new_responses_prompt_is_hashed_as_the_engine_hashes_it(cluster, router_model):
    (_, router), _ = cluster  # kv-aware: it hashes prompts
    body = {"input": "Hash me " * 20, "instructions": "Be kind."}
    respond(router.url, router_model, **body)
    # The index learns the blocks the answer computed from the instance's events, by the
    # engine's hashes: the router's own hashes of the request must find them.
    deadline = time.monotonic() + EVENT_DEADLINE_S
    while True:
        explained = httpx.post(f"{router.url}/router/explain", timeout=TIMEOUT_S, json={
            "path": "/v1/responses", "body": {"model": router_model, **body}}).json()
        cached = max(i["cached_blocks"] for i in explained["instances"])
        if cached == explained["num_prompt_blocks"] or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert explained["num_prompt_blocks"] >= 4 and cached == explained["num_prompt_blocks"]
