"""The Responses API through the router: a stored response lives on the instance that made it,
so a request that goes on from one (`previous_response_id`) and the GET / DELETE of one go
there.

The router learns each response's instance from the answers it relays (a body's `id`, a
stream's `response.created` event) and keeps the most recent `MAX_OWNERS` of them; one it does
not know (the router restarted, or another router relayed it) is looked for on every healthy
instance with `GET /v1/responses/{id}`, the client's key passed on.
"""

from __future__ import annotations

import re
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import Response

from kvtier.entrypoints.openai.errors import NotFoundError, ServiceUnavailableError
from kvtier.router.instances import Instance
from kvtier.router.prompts import RESPONSES_PATH

# Responses whose instance the router remembers; older ones are looked for again.
MAX_OWNERS = 100_000
# The form of a response id (kvtier's: resp_ and 32 hex digits; OpenAI's are alike): the
# router looks for no other, so a client's id never becomes a path on an instance.
_ID_FORM = re.compile(r"resp_[0-9A-Za-z]{1,64}")
# A response's own id: the first "id" of its body, and of a stream's first event.
_RESPONSE_ID = re.compile(rb'"id": ?"(resp_[0-9A-Za-z]{1,64})"')
# Seconds an id no healthy instance stores is not looked for again, and how many such ids are
# remembered: a client repeating one costs the instances one look per this long.
_MISSING_TTL_S = 5.0
_MAX_MISSING = 10_000


class ResponseOwners:
    """response id -> the URL of the instance that stores it, the most recent first kept."""

    def __init__(self, max_entries: int = MAX_OWNERS) -> None:
        self.max_entries = max_entries
        self._owners: OrderedDict[str, str] = OrderedDict()
        # Ids no instance had when looked for, and until when that answer stands.
        self._missing: OrderedDict[str, float] = OrderedDict()

    def learn(self, response_id: str, url: str) -> None:
        self._owners[response_id] = url
        self._owners.move_to_end(response_id)
        while len(self._owners) > self.max_entries:
            self._owners.popitem(last=False)

    def get(self, response_id: str) -> str | None:
        return self._owners.get(response_id)

    def forget(self, response_id: str) -> None:
        self._owners.pop(response_id, None)

    def missing_lately(self, response_id: str) -> bool:
        """Whether no instance stored `response_id` when it was last looked for, lately."""
        expiry = self._missing.get(response_id)
        return expiry is not None and time.monotonic() < expiry

    def note_missing(self, response_id: str) -> None:
        self._missing[response_id] = time.monotonic() + _MISSING_TTL_S
        self._missing.move_to_end(response_id)
        while len(self._missing) > _MAX_MISSING:
            self._missing.popitem(last=False)


def response_id_in(content: bytes) -> str | None:
    """The id of the response a body or a stream's first bytes hold."""
    match = _RESPONSE_ID.search(content)
    return match.group(1).decode() if match else None


def previous_response_id(path: str, body: dict[str, Any]) -> str | None:
    value = body.get("previous_response_id") if path == RESPONSES_PATH else None
    return value if isinstance(value, str) and value else None


async def owner_of(service: Any, response_id: str, headers: dict[str, str]) -> Instance | None:
    """The healthy instance that stores `response_id`, or None (none does, or it is down, or
    it is no response id)."""
    owners = service.response_owners
    if not _ID_FORM.fullmatch(response_id):
        return None
    healthy = [i for i in service.router.instances if i.healthy]
    url = owners.get(response_id)
    known = next((i for i in healthy if i.url == url), None)
    if known is not None or url is not None and url in (i.url for i in service.instances):
        return known  # None: its instance is down, and the response with it
    if owners.missing_lately(response_id):
        return None
    auth = _authorization(headers)
    for instance in healthy:
        try:
            answer = await service.client.get(f"{instance.url}{RESPONSES_PATH}/{response_id}",
                                              headers=auth)
        except httpx.TransportError:
            continue
        if answer.status_code == 200:
            owners.learn(response_id, instance.url)
            return instance
    owners.note_missing(response_id)
    return None


async def at_owner(service: Any, method: str, response_id: str, suffix: str,
                   raw: Request) -> Response:
    """GET or DELETE `/v1/responses/{id}{suffix}` answered by the instance that stores it."""
    headers = _authorization(raw.headers)
    owner = await owner_of(service, response_id, headers)
    if owner is None:
        raise NotFoundError(f"no healthy instance stores a response with id {response_id!r}",
                            param="response_id", code="response_not_found")
    try:
        answer = await service.client.request(
            method, f"{owner.url}{RESPONSES_PATH}/{response_id}{suffix}", headers=headers,
            params=raw.query_params)
    except httpx.TransportError as exc:
        raise ServiceUnavailableError(f"the instance that stores response {response_id!r} did "
                                      f"not answer ({type(exc).__name__}); retry later",
                                      code="upstream_failed") from exc
    if method == "DELETE" and answer.status_code == 200:
        service.response_owners.forget(response_id)
    return Response(answer.content, answer.status_code,
                    media_type=answer.headers.get("content-type"))


def _authorization(headers: Mapping[str, str]) -> dict[str, str]:
    """The client's key, the one header an instance's stored responses need."""
    return {k: v for k, v in headers.items() if k.lower() == "authorization"}
