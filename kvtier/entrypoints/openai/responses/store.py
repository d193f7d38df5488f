"""The responses a server keeps for `previous_response_id` and GET /v1/responses/{id}.

In memory on the instance that made them, bounded in bytes (an estimate of the memory each
takes: its JSON size plus Python's per-object overhead): the least
recently used response goes first when a new one needs room. One larger than the whole bound
is not kept. Ids are random, so a client reaches only the responses whose ids it was given.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from kvtier.entrypoints.openai.responses.convert import Message, json_size

# What a server keeps unless told otherwise (--responses-store-size).
DEFAULT_STORE_BYTES = 128 * 2 ** 20
# Python's own bytes per parsed JSON object beyond its text (CPython 3.11, 64-bit: a small
# dict and its keys, a list and its pointers, a str header).
_DICT_BYTES, _LIST_BYTES, _STR_BYTES = 232, 72, 49


@dataclass(frozen=True)
class StoredResponse:
    # The response object as clients got it (JSON-ready).
    response: dict[str, Any]
    # The conversation up to and including its answer, without instructions (those of an
    # earlier response do not carry over to the next, as in OpenAI's API).
    messages: list[Message]
    # This request's own input items, each with an id (GET .../input_items).
    input_items: list[dict[str, Any]]

    @property
    def num_bytes(self) -> int:
        """About the memory it takes: its JSON size, and what Python adds per object and per
        string (a dict ~200 bytes, a string ~50 bytes besides its characters)."""
        parts = (self.response, self.messages, self.input_items)
        return sum(json_size(part) + _object_overhead(part) for part in parts)


def _object_overhead(value: Any) -> int:
    """Bytes Python spends on the containers and strings of parsed JSON beyond their text."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            total += _DICT_BYTES
            stack.extend(item.values())
        elif isinstance(item, list):
            total += _LIST_BYTES
            stack.extend(item)
        elif isinstance(item, str):
            total += _STR_BYTES
    return total


class ResponseStore:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, stored: StoredResponse) -> bool:
        """Keeps `stored`, making room by dropping the least recently used; False (nothing
        kept) for one larger than the bound."""
        size = stored.num_bytes
        if size > self.max_bytes:
            return False
        self.delete(response_id)
        while self.num_bytes + size > self.max_bytes:
            _, (_, dropped) = self._entries.popitem(last=False)
            self.num_bytes -= dropped
        self._entries[response_id] = (stored, size)
        self.num_bytes += size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        self._entries.move_to_end(response_id)
        return entry[0]

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.num_bytes -= entry[1]
        return True
