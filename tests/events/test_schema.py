"""decode_batch on payloads that are msgpack but not this schema: each is an EventDecodeError
(which a subscriber skips), never another exception, and never a batch with values of the
wrong type."""

from __future__ import annotations

import msgpack
import pytest

from kvtier.events import BlockStored, EventBatch, EventDecodeError, decode_batch

INF = float("inf")


def stored(**fields) -> dict:
    return {"type": "BlockStored", "block_hashes": [1], "block_size": 16, "medium": "GPU",
            **fields}


@pytest.mark.parametrize("batch", [
    [0.0, [], INF],  # a rank that int() cannot take
    [0.0, [], 1.5],
    [0.0, [], True],
    [INF, []],
    [float("nan"), []],
    ["now", []],
    [0.0, "not events"],
    [0.0, [7]],
    [0.0],
    {"ts": 0.0},
    [0.0, [stored(block_size=INF)]],
    [0.0, [stored(block_size=16.0)]],
    [0.0, [stored(block_size=True)]],
    [0.0, [stored(block_hashes=[1.0])]],
    [0.0, [stored(token_ids=[1, INF])]],
    [0.0, [stored(lora_id="a")]],
    [0.0, [stored(medium=5)]],
    [0.0, [stored(group_idx=INF)]],
    [0.0, [stored(locality=["LOCAL"])]],
    [0.0, [{"type": "BlockRemoved", "block_hashes": 5}]],
], ids=repr)
def test_values_of_the_wrong_type_are_a_decode_error(batch):
    with pytest.raises(EventDecodeError, match="not a KV event batch"):
        decode_batch(msgpack.packb(batch))


def test_every_type_the_schema_allows_decodes():
    payload = msgpack.packb([5, [stored(lora_id=3, group_idx=0, locality="REMOTE"),
                                 {"type": "SomethingNewer", "x": INF}], None])
    assert decode_batch(payload) == EventBatch(5.0, [BlockStored(
        [1], None, [], 16, 3, "GPU", group_idx=0, locality="remote")], 0)
