"""The router hashes prompts exactly as the engine does: same token ids through the server's
prompt code (chat template included), same block hashes as the engine's events name, on the
device and on the host tier (chunks of two blocks)."""

from __future__ import annotations

import pytest

from kvtier.engine.kv_events import to_wire_event
from kvtier.engine.llm import LLM
from kvtier.events import BlockRemoved, BlockStored
from kvtier.router.prompts import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    MESSAGES_PATH,
    PromptHasher,
    load_tokenizer,
)
from kvtier.sampling_params import SamplingParams

from ..tiny_models import make_hf_model

BLOCK = 4


@pytest.fixture(scope="module")
def engine_and_hasher(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("router_prompts"))
    make_hf_model("llama", directory, tokenizer="bytes")
    llm = LLM(directory, dtype="float32", block_size=BLOCK, enable_kv_cache_events=True,
              kv_offload="host=1MiB,blocks_per_chunk=2")
    yield llm, PromptHasher(load_tokenizer(directory), BLOCK, "sha256_cbor"), directory
    llm.engine.shutdown()


def engine_events(llm, token_ids, cache_salt=None) -> list:
    llm.engine.add_request("r", token_ids, SamplingParams(max_tokens=1, temperature=0),
                           cache_salt=cache_salt)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    # The host tier's copies are reported by the worker one step after the request's last.
    llm.engine.step()
    return [to_wire_event(e) for e in llm.engine.take_kv_events()]


def hashes_of(events, kind, medium) -> list[int]:
    return [h for e in events if isinstance(e, kind) and e.medium == medium
            for h in e.block_hashes]


BODIES = [
    (CHAT_PATH, {"messages": [{"role": "system", "content": "Be brief."},
                              {"role": "user", "content": "Which tier holds my prefix?"}]}),
    # No system prompt: its blocks would be the chat body's, found in the host tier.
    (MESSAGES_PATH, {"max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Which tier holds my turn?"}]}]}),
    (COMPLETIONS_PATH, {"prompt": "a plain text prompt of a few blocks"}),
    (COMPLETIONS_PATH, {"prompt": [[5, 6, 7, 8, 9, 10, 11, 12, 13]]}),
    (COMPLETIONS_PATH, {"prompt": "a plain text prompt of a few blocks",
                        "cache_salt": "tenant-7"}),
]


@pytest.mark.parametrize(("path", "body"), BODIES)
def test_router_and_engine_agree_on_every_block_hash(engine_and_hasher, path, body):
    llm, hasher, model = engine_and_hasher
    body = {"model": model, **body}
    token_ids = hasher.token_ids(path, body)
    if path in (CHAT_PATH, MESSAGES_PATH):  # the chat template's own tokens lead the prompt
        assert token_ids[0] == llm.engine.tokenizer.backend.token_to_id("<|im_start|>")
    if path == MESSAGES_PATH:  # the same prompt as the chat it becomes
        assert token_ids == hasher.token_ids(CHAT_PATH, {"model": model, "messages": [
            {"role": "user", "content": "Which tier holds my turn?"}]})
    expected = hasher.block_hashes_of(token_ids, body.get("cache_salt"))
    assert len(expected) == len(token_ids) // BLOCK >= 2
    events = engine_events(llm, token_ids, body.get("cache_salt"))
    assert hashes_of(events, BlockStored, "GPU")[:len(expected)] == expected
    # Host memory takes whole chunks of 2 blocks, named by the same block hashes.
    assert hashes_of(events, BlockStored, "CPU") == expected[:len(expected) // 2 * 2]
    llm.engine.reset_prefix_cache()


def test_a_salt_changes_every_hash_and_unreadable_bodies_hash_to_nothing(engine_and_hasher):
    _, hasher, model = engine_and_hasher
    plain = hasher.block_hashes_of(list(range(5, 17)))
    salted = hasher.block_hashes_of(list(range(5, 17)), "s")
    assert len(plain) == 3 and not set(plain) & set(salted)
    assert hasher.token_ids(CHAT_PATH, {"model": model, "messages": "not a list"}) is None
    assert hasher.token_ids(COMPLETIONS_PATH, {"model": model, "prompt": []}) is None
    assert hasher.token_ids(COMPLETIONS_PATH, {"model": model}) is None


def test_host_evictions_go_out_as_removals_by_block_hash(tmp_path):
    make_hf_model("llama", str(tmp_path), tokenizer="bytes")
    # Two host slots of one block each: a second prompt's blocks evict the first's.
    llm = LLM(str(tmp_path), dtype="float32", block_size=BLOCK, enable_kv_cache_events=True,
              kv_offload="host=4KiB", num_device_blocks=32)
    try:
        hasher = PromptHasher(load_tokenizer(str(tmp_path)), BLOCK, "sha256_cbor")
        first, second = list(range(5, 5 + 2 * BLOCK + 1)), list(range(50, 50 + 2 * BLOCK + 1))
        events = engine_events(llm, first)
        assert hashes_of(events, BlockStored, "CPU") == hasher.block_hashes_of(first)
        events = engine_events(llm, second)
        assert hashes_of(events, BlockStored, "CPU") == hasher.block_hashes_of(second)
        assert sorted(hashes_of(events, BlockRemoved, "CPU")) == \
            sorted(hasher.block_hashes_of(first))
    finally:
        llm.engine.shutdown()


def test_kv_events_info_lora_adapters_are_read_and_checked():
    from kvtier.router.instances import EventsInfo

    base = {"publishing": True, "endpoint": "tcp://127.0.0.1:1", "block_size": 16,
            "hash_algo": "sha256_cbor", "model": "/m"}
    assert EventsInfo.from_json(base).lora_adapters == {}
    info = EventsInfo.from_json({**base, "lora_adapters": {"a": "k1"}})
    assert info.lora_adapters == {"a": "k1"}
    for bad in ({"a": 1}, ["a"], "a"):
        with pytest.raises(ValueError, match="malformed kv_events_info"):
            EventsInfo.from_json({**base, "lora_adapters": bad})
