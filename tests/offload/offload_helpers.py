"""Chunks, keys and configs for the tiering tests, and the worker's side of a store."""

import time

from kvtier.offload.config import OffloadConfig
from kvtier.offload.keys import make_chunk_key
from kvtier.offload.manager import Lookup, TieringManager

NAMESPACE = bytes(range(32))
CHUNK = 64
# The out-of-tree test tiers, as a tier config's module_path names them.
FAULTY_TIERS = "tests.offload.faulty_tiers"


def key(n: int):
    return make_chunk_key(NAMESPACE, 0, n.to_bytes(32, "big"))


def chunk_bytes(n: int) -> bytes:
    return bytes((n * 7 + i) % 256 for i in range(CHUNK))


def offload_config(num_slots: int, tiers=(), **extra) -> OffloadConfig:
    return OffloadConfig.from_extra_config({"cpu_bytes_to_use": num_slots * CHUNK,
                                            "secondary_tiers": list(tiers), **extra})


def store_from_device(manager: TieringManager, n: int) -> None:
    """Play the worker's part of a device->host store of chunk n."""
    manager.record_use(key(n))
    slot = manager.prepare_store(key(n), CHUNK)
    assert slot is not None
    manager.area.slot_view(slot, CHUNK)[:] = chunk_bytes(n)
    manager.complete_store(key(n), ok=True)


def poll_until(manager: TieringManager, n: int, timeout: float = 10.0) -> Lookup:
    """Poll until chunk n's lookup is not RETRY (promotions run on tier threads)."""
    deadline = time.monotonic() + timeout
    while True:
        manager.poll()
        answer = manager.lookup(key(n), CHUNK)
        if answer is not Lookup.RETRY or time.monotonic() > deadline:
            return answer
        time.sleep(0.005)


def read_host(manager: TieringManager, n: int) -> bytes:
    slot = manager.prepare_load(key(n))
    data = bytes(manager.area.slot_view(slot, CHUNK))
    manager.complete_load(key(n), ok=True)
    return data
