"""Deterministic chained block hashes: the identity of a prefix, equal in every process.

hash(block i) = H(parent_hash, token_ids of block i, extra_keys of block i), where the parent of
block 0 is a fixed seed hash. H works on canonical CBOR bytes, never on Python's `hash()`, so no
PYTHONHASHSEED, process, or machine can change a key.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any, NewType

import cbor2
import xxhash

if TYPE_CHECKING:
    from kvtier.kv.request import Request

BlockHash = NewType("BlockHash", bytes)

# A function (parent, block token ids, extra keys) -> BlockHash.
HashFunction = Callable[[bytes, Sequence[int], "tuple[Any, ...] | None"], BlockHash]

# Changing either constant changes every key ever written: bump the version instead of editing.
_SEED_TEXT = b"kvtier/block-hash-seed/v1"
_XXHASH_SEED = 0x6B76_7469_6572  # "kvtier"
_NAMESPACE_VERSION = "kvtier/namespace/v2"
# Keys of KVIdentity.describe() that are not field names.
_DESCRIBED_AS = frozenset({"namespace", "version", "model"})


def _sha256_cbor(parent: bytes, token_ids: Sequence[int], extra_keys: Any) -> BlockHash:
    payload = cbor2.dumps((parent, token_ids, extra_keys), canonical=True)
    return BlockHash(hashlib.sha256(payload).digest())


def _xxh3_cbor(parent: bytes, token_ids: Sequence[int], extra_keys: Any) -> BlockHash:
    payload = cbor2.dumps((parent, token_ids, extra_keys), canonical=True)
    return BlockHash(xxhash.xxh3_128_digest(payload, seed=_XXHASH_SEED))


_HASH_FUNCTIONS: dict[str, HashFunction] = {
    "sha256_cbor": _sha256_cbor,
    "xxhash": _xxh3_cbor,
}
HASH_ALGOS = tuple(_HASH_FUNCTIONS)


def get_hash_function(hash_algo: str) -> HashFunction:
    try:
        return _HASH_FUNCTIONS[hash_algo]
    except KeyError:
        raise ValueError(f"hash_algo must be one of {HASH_ALGOS}, got {hash_algo!r}") from None


def seed_hash(hash_algo: str = "sha256_cbor") -> BlockHash:
    """The parent hash of block 0: a constant of the algorithm, identical in every process."""
    return get_hash_function(hash_algo)(_SEED_TEXT, (), None)


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int],
                      extra_keys: tuple[Any, ...] | None = None,
                      hash_algo: str = "sha256_cbor") -> BlockHash:
    """Hash one full block outside a Request; `parent_hash=None` means block 0."""
    parent = seed_hash(hash_algo) if parent_hash is None else parent_hash
    return get_hash_function(hash_algo)(parent, list(token_ids), extra_keys)


def block_extra_keys(request: Request, start: int, end: int) -> tuple[Any, ...] | None:
    """Everything besides the tokens of [start, end) that changes their KV; None when nothing."""
    keys: list[Any] = []
    if request.lora is not None:
        # The adapter's content, not its name: no instance serves one adapter's KV to another
        # that took the same name.
        keys.append(request.lora.cache_key)
    elif request.lora_name is not None:
        keys.append(request.lora_name)
    for feature in request.mm_features:
        if feature.offset < end and feature.offset + feature.length > start:
            # The offset tells apart the same item placed at different positions in the block.
            keys.append((feature.identifier, feature.offset - start))
    if start == 0 and request.cache_salt is not None:
        keys.append(request.cache_salt)
    return tuple(keys) if keys else None


def make_block_hasher(block_size: int,
                      hash_algo: str = "sha256_cbor") -> Callable[[Request], list[BlockHash]]:
    """Build the function a Request calls to hash its newly full blocks.

    The returned function hashes the blocks of `request.all_token_ids` that are full but not yet
    in `request.block_hashes`, chaining from the last known hash, and returns only those.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    hash_fn = get_hash_function(hash_algo)
    seed = seed_hash(hash_algo)

    def hash_new_full_blocks(request: Request) -> list[BlockHash]:
        known = request.block_hashes
        start = len(known) * block_size
        token_ids = request.all_token_ids
        num_tokens = len(token_ids)
        new_hashes: list[BlockHash] = []
        if start + block_size > num_tokens:
            return new_hashes  # most decode steps: the last block is not full yet
        parent = known[-1] if known else seed
        while start + block_size <= num_tokens:
            end = start + block_size
            parent = hash_fn(parent, token_ids[start:end], block_extra_keys(request, start, end))
            new_hashes.append(parent)
            start = end
        return new_hashes

    return hash_new_full_blocks


@dataclass(frozen=True)
class KVIdentity:
    """Everything that decides the bytes of a block's KV outside its tokens.

    Two instances with equal identities compute interchangeable KV, so they may share stored
    chunks; `namespace` (a digest of it) prefixes every key they write outside the process.
    Instances agree on it without talking: every field is derived from what they run.
    """

    # Shown to operators only, never hashed: two paths to the same weights share a namespace.
    model_name: str
    # Content digest of the weight files and the model's config (hex).
    weights_digest: str
    dtype: str
    block_size: int
    kv_layout: str
    # One kind per KV cache group, in group order (a sliding window with its size).
    spec_kinds: tuple[str, ...]
    # (name, value) facts a connector adds about how it lays KV out outside the process
    # (e.g. blocks_per_chunk), sorted by name; see `extended`.
    extra: tuple[tuple[str, int | str], ...] = ()

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size}")
        if not self.weights_digest:
            raise ValueError("weights_digest must be a non-empty string")

    def extended(self, **facts: int | str) -> KVIdentity:
        """This identity plus `facts` that change what a connector writes for the same KV."""
        taken = {f.name for f in fields(self)} | dict(self.extra).keys() | _DESCRIBED_AS
        clash = facts.keys() & taken
        if clash:
            raise ValueError(f"identity facts {sorted(clash)} are already set")
        return replace(self, extra=tuple(sorted((*self.extra, *facts.items()))))

    @cached_property
    def namespace(self) -> bytes:
        return namespace_digest(self)

    def describe(self) -> dict[str, Any]:
        """What the namespace covers, as JSON-ready values (description files, logs)."""
        return {"namespace": self.namespace.hex(), "version": _NAMESPACE_VERSION,
                "model": self.model_name, "weights_digest": self.weights_digest,
                "dtype": self.dtype, "block_size": self.block_size, "kv_layout": self.kv_layout,
                "spec_kinds": list(self.spec_kinds), **dict(self.extra)}


def namespace_digest(identity: KVIdentity) -> bytes:
    """Prefix for every key written outside the process.

    Covers every field of `identity` but the model's name, so instances whose KV bytes are not
    interchangeable (other weights, dtype, block size, layout, KV spec kinds or connector
    facts) get different digests and can share a store without reading each other's data.
    """
    payload = cbor2.dumps(
        (_NAMESPACE_VERSION, identity.weights_digest, identity.dtype, identity.block_size,
         identity.kv_layout, list(identity.spec_kinds), [list(f) for f in identity.extra]),
        canonical=True)
    return hashlib.sha256(payload).digest()
