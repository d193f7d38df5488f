"""Block hashing: deterministic bytes, extra keys, incremental growth, namespace digest."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from dataclasses import replace

import cbor2
import pytest

from kvtier.kv import (
    KVIdentity,
    MultiModalFeature,
    Request,
    hash_block_tokens,
    make_block_hasher,
    namespace_digest,
    seed_hash,
)
from kvtier.kv.hashing import block_extra_keys

_HASH_SCRIPT = """
from kvtier.kv import Request, make_block_hasher
for algo in ("sha256_cbor", "xxhash"):
    r = Request("x", list(range(10)), cache_salt="tenant", block_hasher=make_block_hasher(4, algo))
    print(algo, ",".join(h.hex() for h in r.block_hashes))
"""


def _hashes_in_fresh_process(python_hash_seed: str) -> str:
    env = dict(os.environ, PYTHONHASHSEED=python_hash_seed)
    result = subprocess.run([sys.executable, "-c", _HASH_SCRIPT], env=env, capture_output=True,
                            text=True, timeout=60, check=True)
    return result.stdout


def test_two_fresh_processes_compute_identical_hashes():
    first = _hashes_in_fresh_process("1")
    second = _hashes_in_fresh_process("987654")
    assert first == second
    here = Request("x", list(range(10)), cache_salt="tenant",
                   block_hasher=make_block_hasher(4, "sha256_cbor"))
    assert first.splitlines()[0] == "sha256_cbor " + ",".join(h.hex() for h in here.block_hashes)


def test_hash_values_are_pinned():
    # A change here changes every key written outside the process: bump the seed version.
    assert seed_hash().hex()[:16] == SEED_SHA256_PREFIX
    assert hash_block_tokens(None, [1, 2, 3, 4]).hex()[:16] == BLOCK_SHA256_PREFIX
    assert hash_block_tokens(None, [1, 2, 3, 4], hash_algo="xxhash").hex() == BLOCK_XXH3_HEX


SEED_SHA256_PREFIX = "28fa19928a2dfe22"
BLOCK_SHA256_PREFIX = "4e8199f9ec41b20b"
BLOCK_XXH3_HEX = "fe7b17fb70f2862d44a98afbd46f7b84"


def test_default_hash_is_sha256_of_canonical_cbor():
    payload = cbor2.dumps((seed_hash(), [1, 2, 3, 4], None), canonical=True)
    assert hash_block_tokens(None, [1, 2, 3, 4]) == hashlib.sha256(payload).digest()


def test_hashes_chain_over_the_whole_prefix():
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    other_h0 = hash_block_tokens(None, [1, 2, 3, 5])
    assert hash_block_tokens(h0, [9, 9, 9, 9]) != hash_block_tokens(other_h0, [9, 9, 9, 9])
    assert len(h0) == 32
    assert len(hash_block_tokens(None, [1, 2, 3, 4], hash_algo="xxhash")) == 16


def test_request_hashes_only_full_blocks_and_grow_with_output():
    hasher = make_block_hasher(4)
    growing = Request("g", list(range(6)), block_hasher=hasher)
    assert len(growing.block_hashes) == 1
    growing.append_output_token_ids(6)
    assert len(growing.block_hashes) == 1
    growing.append_output_token_ids([7, 8, 9, 10, 11])
    whole = Request("w", list(range(12)), block_hasher=hasher)
    assert growing.block_hashes == whole.block_hashes
    assert len(whole.block_hashes) == 3
    assert whole.block_hashes[1] == hash_block_tokens(whole.block_hashes[0], [4, 5, 6, 7])


def test_extra_keys_salt_first_block_lora_and_multimodal_offsets():
    image = MultiModalFeature(identifier="img-1", offset=2, length=4)
    request = Request("r", list(range(12)), cache_salt="s", lora_name="lora-a",
                      mm_features=[image])
    assert block_extra_keys(request, 0, 4) == ("lora-a", ("img-1", 2), "s")
    assert block_extra_keys(request, 4, 8) == ("lora-a", ("img-1", -2))
    assert block_extra_keys(request, 8, 12) == ("lora-a",)
    assert block_extra_keys(Request("p", list(range(8))), 0, 4) is None


def test_extra_keys_change_the_hash():
    hasher = make_block_hasher(4)
    plain = Request("a", list(range(8)), block_hasher=hasher).block_hashes
    salted = Request("b", list(range(8)), cache_salt="t", block_hasher=hasher).block_hashes
    lora = Request("c", list(range(8)), lora_name="x", block_hasher=hasher).block_hashes
    assert len({plain[0], salted[0], lora[0]}) == 3
    # Salting block 0 changes every later hash through the chain.
    assert plain[1] != salted[1]


def test_unknown_hash_algorithm_and_bad_block_size_are_rejected():
    with pytest.raises(ValueError, match="hash_algo"):
        make_block_hasher(4, "md5")
    with pytest.raises(ValueError, match="block_size"):
        make_block_hasher(0)


_IDENTITY = KVIdentity(model_name="SmolLM2-135M", weights_digest="ab" * 16, dtype="float16",
                       block_size=16, kv_layout="host-page-v1", spec_kinds=("full_attention",))


def test_namespace_digest_separates_incompatible_kv():
    digest = namespace_digest(_IDENTITY)
    assert digest == _IDENTITY.namespace == namespace_digest(replace(_IDENTITY))
    assert len(digest) == 32
    variants = [replace(_IDENTITY, weights_digest="cd" * 16),
                replace(_IDENTITY, dtype="bfloat16"), replace(_IDENTITY, block_size=32),
                replace(_IDENTITY, kv_layout="other"),
                replace(_IDENTITY, spec_kinds=("full_attention", "sliding_window")),
                _IDENTITY.extended(blocks_per_chunk=1), _IDENTITY.extended(blocks_per_chunk=2)]
    assert len({digest, *(v.namespace for v in variants)}) == 8


def test_the_model_name_is_not_part_of_the_namespace():
    # The same weights loaded from another path (or under another name) share their KV.
    assert replace(_IDENTITY, model_name="/elsewhere/model").namespace == _IDENTITY.namespace


def test_extended_facts_are_order_free_and_never_overwrite():
    one = _IDENTITY.extended(blocks_per_chunk=2, chunk_format="KVTC/1")
    assert one == _IDENTITY.extended(chunk_format="KVTC/1").extended(blocks_per_chunk=2)
    assert one.namespace == _IDENTITY.extended(chunk_format="KVTC/1",
                                               blocks_per_chunk=2).namespace
    with pytest.raises(ValueError, match=r"\['blocks_per_chunk'\] are already set"):
        one.extended(blocks_per_chunk=1)
    with pytest.raises(ValueError, match=r"\['dtype'\] are already set"):
        _IDENTITY.extended(dtype="float32")
    with pytest.raises(ValueError, match=r"\['model', 'namespace'\] are already set"):
        _IDENTITY.extended(namespace="x", model="y")  # keys describe() uses


def test_describe_lists_what_the_namespace_covers():
    described = _IDENTITY.extended(blocks_per_chunk=2).describe()
    assert described == {
        "namespace": _IDENTITY.extended(blocks_per_chunk=2).namespace.hex(),
        "version": "kvtier/namespace/v2", "model": "SmolLM2-135M", "weights_digest": "ab" * 16,
        "dtype": "float16", "block_size": 16, "kv_layout": "host-page-v1",
        "spec_kinds": ["full_attention"], "blocks_per_chunk": 2}


def test_identity_rejects_a_bad_block_size_or_no_weights_digest():
    with pytest.raises(ValueError, match="block_size"):
        replace(_IDENTITY, block_size=0)
    with pytest.raises(ValueError, match="weights_digest"):
        replace(_IDENTITY, weights_digest="")
