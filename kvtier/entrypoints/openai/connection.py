"""Per-connection concerns: the request id a client asked for, and noticing it has gone."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

T = TypeVar("T")
REQUEST_ID_HEADER = "X-Request-Id"
# Longest client-chosen id accepted; longer ones are replaced by a generated id.
_MAX_REQUEST_ID_LEN = 256


def base_request_id(raw: Request) -> str:
    """The client's X-Request-Id if it sent a usable one, else a fresh random id."""
    asked = raw.headers.get(REQUEST_ID_HEADER)
    if asked and len(asked) <= _MAX_REQUEST_ID_LEN and asked.isprintable():
        return asked
    return uuid.uuid4().hex


async def _wait_for_disconnect(raw: Request) -> None:
    # The body is already read, so the next ASGI message is the disconnect.
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(raw: Request, work: Awaitable[T]) -> T | None:
    """Run `work`; if the client disconnects first, cancel it (aborting its engine requests)
    and return None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return None
