"""The content identity of a model: a digest of the files its KV depends on.

It enters the KV namespace (kvtier.kv.hashing.KVIdentity), so weights replaced at the same path
give a new namespace and no tier serves the old model's KV, while the same weights at two paths
share one. Hashing gigabytes at every start would be slow, so each file's digest is cached by
(real path, size, mtime_ns, ctime_ns) in a small JSON file under the user's cache directory; the
ctime also catches a copy that kept the old file's size and mtime (cp -p, tar), and a file
changed in the last RACY_NS is not remembered. A cache that cannot be read or written costs a
rehash, never a failed start.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import cbor2
import xxhash

from kvtier.models.loader import default_model_path
from kvtier.models.safetensors_weights import safetensors_files

logger = logging.getLogger(__name__)

CACHE_FILE_NAME = "weight_digests.json"
_CACHE_VERSION = 1
_READ_BYTES = 16 * 1024 * 1024
# A file changed this recently may change again within one tick of the file system's clock
# (coarse on Linux, up to seconds on network file systems) without a new mtime: its digest is
# used but not remembered.
RACY_NS = 2_000_000_000


def model_files(model: str | None) -> list[str]:
    """The files whose bytes decide the model's KV: safetensors shards and config.json of an HF
    directory (not the tokenizer: prompts are keyed by token ids), or the GGUF file; `model` as
    `load_model` takes it (None: the packaged default)."""
    path = default_model_path() if model is None else os.path.expanduser(model)
    if not os.path.isdir(path):
        return [path]
    config = os.path.join(path, "config.json")
    return safetensors_files(path) + ([config] if os.path.isfile(config) else [])


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvtier")


def weights_digest(files: Sequence[str], cache_dir: str | None = None) -> str:
    """xxh3-128 (hex) over each file's name and content digest, in the order given."""
    cache = FileDigestCache(default_cache_dir() if cache_dir is None else cache_dir)
    digests = [(os.path.basename(path), cache.digest(path)) for path in files]
    cache.save()
    return xxhash.xxh3_128_hexdigest(cbor2.dumps(digests, canonical=True))


class FileDigestCache:
    """File content digests (xxh3-128 hex) remembered across runs, keyed by each file's stat."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, CACHE_FILE_NAME)
        self._entries = _read_entries(self.path)
        self._changed = False

    def digest(self, path: str) -> str:
        real = os.path.realpath(path)
        entry = self._entries.get(real)
        if entry is not None and entry["stat"] == _stamp(os.stat(real)):
            return entry["xxh3_128"]
        started = time.perf_counter()
        with open(real, "rb") as f:
            before = _stamp(os.fstat(f.fileno()))
            digest = _hash_stream(f)
            # A file rewritten while it was read has no digest worth remembering.
            if _stamp(os.fstat(f.fileno())) == before and not _is_racy(before):
                self._entries[real] = {"stat": before, "xxh3_128": digest}
                self._changed = True
        logger.info("hashed %s (%d bytes) in %.2f s for the KV namespace", real, before[0],
                    time.perf_counter() - started)
        return digest

    def save(self) -> None:
        """Write the cache if it changed, dropping files that are gone; failures only log."""
        if not self._changed:
            return
        entries = {path: e for path, e in self._entries.items() if os.path.exists(path)}
        tmp = f"{self.path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open(tmp, "w") as f:
                json.dump({"version": _CACHE_VERSION, "files": entries}, f, indent=1)
            os.replace(tmp, self.path)
        except OSError as exc:
            logger.warning("cannot write the weight digest cache %s (%s); the weights will be "
                           "hashed again at the next start", self.path, exc)
            _unlink_quietly(tmp)
        self._changed = False


def _stamp(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _is_racy(stamp: list[int]) -> bool:
    return time.time_ns() - max(stamp[1], stamp[2]) < RACY_NS


def _hash_stream(f: Any) -> str:
    hasher = xxhash.xxh3_128()
    buffer = memoryview(bytearray(_READ_BYTES))
    while n := f.readinto(buffer):
        hasher.update(buffer[:n])
    return hasher.hexdigest()


def _read_entries(path: str) -> dict[str, dict[str, Any]]:
    """The cache's entries; a missing, unreadable or malformed cache is an empty one."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != _CACHE_VERSION:
        return {}
    files = data.get("files")
    if not isinstance(files, dict):
        return {}
    return {path: entry for path, entry in files.items() if _is_entry(entry)}


def _is_entry(entry: Any) -> bool:
    return (isinstance(entry, dict) and isinstance(entry.get("xxh3_128"), str)
            and isinstance(entry.get("stat"), list) and len(entry["stat"]) == 3
            and all(isinstance(v, int) for v in entry["stat"]))


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
