"""P/D mode: each prompt is computed on a prefill instance, which sends its KV to the decode
instance chosen for the request; the decode instance loads it and only decodes.

    router -> prefill  the client's body, max_tokens=1, stream off,
                       kv_transfer_params={"transfer_id": T, "consumer_address": A}
    prefill -> router  kv_transfer_params={"transfer_id": T, "num_tokens": N, "block_hash": H}
    router -> decode   the client's body, kv_transfer_params as the prefill instance returned

A is the decode instance's transfer engine address (its GET /v1/kv_transfer_info), T is fresh
for every prefill. When no prefill instance does its part (none healthy, unreachable, an error
answer, past `prefill_timeout_s`, no kv_transfer_params in its answer) the decode instance gets
the client's body without kv_transfer_params and computes the prompt itself: the client sees
the same tokens, only later. So it does for a request the instance would split into several
(n > 1, several prompts), and, with `local_prefill_tokens`, for a prompt the decode instance
has cached all but that many tokens of.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx

from kvtier.router.instances import Instance
from kvtier.router.policy import NoInstanceError
from kvtier.router.prompts import CHAT_PATH, MESSAGES_PATH, RESPONSES_PATH
from kvtier.router.service import RouterService

# Request fields that concern the answer, not the prompt: the prefill leaves them out.
_ANSWER_FIELDS = ("stream_options", "min_tokens", "max_completion_tokens", "max_output_tokens",
                  "kv_transfer_params")


async def with_prefilled_kv(service: RouterService, path: str, body: dict[str, Any],
                            headers: dict[str, str], block_hashes: list[int],
                            decode: Instance, uncached_tokens: int | None) -> bytes:
    """The body to send `decode`: the client's, with the kv_transfer_params of the prefill done
    for it, or without any when no prefill instance could do it or `decode` lacks few enough
    of the prompt's tokens (`uncached_tokens`, None: not known) to compute them itself."""
    params, outcome = None, "no_transport"
    local = service.config.local_prefill_tokens
    if fans_out(body):
        outcome = "fan_out"
    elif uncached_tokens is not None and uncached_tokens <= local:
        outcome = "local"
    elif decode.transport_address is not None:
        params, outcome = await _prefill(service, path, body, headers, block_hashes,
                                         decode.transport_address)
    service.metrics.prefills.labels(outcome).inc()
    forwarded = {key: value for key, value in body.items() if key != "kv_transfer_params"}
    if params is not None:
        forwarded["kv_transfer_params"] = params
    return json.dumps(forwarded).encode()


def fans_out(body: dict[str, Any]) -> bool:
    """Whether the instance makes several engine requests of this body (n > 1, several
    prompts): one transfer carries one prompt's KV to one request, so these are not split."""
    prompt = body.get("prompt")
    several_prompts = isinstance(prompt, list) and len(prompt) > 1 and \
        not isinstance(prompt[0], int)
    # A null is a field left out, as the instances read it.
    return several_prompts or body.get("n") not in (None, 1) \
        or body.get("best_of") not in (None, 1)


def prefill_body(path: str, body: dict[str, Any], transfer_id: str,
                 consumer_address: str) -> dict[str, Any]:
    """The client's request cut to its prompt: one token, one choice, no stream."""
    request = {key: value for key, value in body.items() if key not in _ANSWER_FIELDS}
    request.update(max_tokens=1, n=1, stream=False, kv_transfer_params={
        "transfer_id": transfer_id, "consumer_address": consumer_address})
    if path == CHAT_PATH:
        request.pop("max_tokens")
        request["max_completion_tokens"] = 1
    elif path == RESPONSES_PATH:  # and the prefill's answer is not kept as a response
        del request["max_tokens"], request["n"]
        request.update(max_output_tokens=1, store=False)
    elif path == MESSAGES_PATH:  # Anthropic's API has no n
        del request["n"]
    return request


async def _prefill(service: RouterService, path: str, body: dict[str, Any],
                   headers: dict[str, str], block_hashes: list[int],
                   consumer_address: str) -> tuple[dict[str, Any] | None, str]:
    """The prefill's kv_transfer_params for the decode instance, and the outcome."""
    assert service.prefill_router is not None
    block_size = service.hasher.block_size if service.hasher is not None else 1
    try:
        decision = service.prefill_router.choose(block_hashes, block_size)
    except NoInstanceError:
        return None, "no_instance"
    instance, transfer_id = decision.instance, uuid.uuid4().hex
    content = json.dumps(prefill_body(path, body, transfer_id, consumer_address)).encode()
    timeout = httpx.Timeout(service.config.prefill_timeout_s,
                            connect=service.config.connect_timeout_s)
    service.add_in_flight(instance, 1)
    try:
        response = await service.client.post(instance.url + path, content=content,
                                             headers=headers, timeout=timeout)
    except (httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout):
        return None, "timeout"  # busy, not gone: its health checks decide
    except httpx.TransportError:
        service.mark_down(instance, "unreachable")
        return None, "unreachable"
    finally:
        service.add_in_flight(instance, -1)
    if response.status_code != 200:
        return None, f"status_{response.status_code // 100}xx"
    params = _returned_params(response, transfer_id)
    if params is None:
        return None, "no_kv_transfer_params"
    service.expect_events(instance, len(block_hashes)
                          - decision.predicted_cached_tokens // block_size)
    return params, "ok"


def _returned_params(response: httpx.Response, transfer_id: str) -> dict[str, Any] | None:
    """The answer's kv_transfer_params when they name our transfer; None otherwise (an
    instance without a producer connector returns none)."""
    try:
        params = response.json().get("kv_transfer_params")
    except (ValueError, AttributeError):
        return None
    if not isinstance(params, dict) or params.get("transfer_id") != transfer_id \
            or type(params.get("num_tokens")) is not int:
        return None
    passed = {"transfer_id": transfer_id, "num_tokens": params["num_tokens"]}
    if isinstance(params.get("block_hash"), str):  # the decode instance checks its prefix
        passed["block_hash"] = params["block_hash"]
    return passed
