"""The network-store tiers (obj, redis) in the benchmarks: a throwaway store on 127.0.0.1 when the
command names none, and a tier's chunk PUT/GET throughput next to its client library's raw
throughput on the same objects.

The raw figures use the tier's own client (same connection pool and timeouts) from as many
threads as the tier has, on the very names and bytes (the checked chunk format) the tier writes,
so the difference between the two is the tier's path: its job queue and threads, the chunk
encoding and checks, its index and byte accounting.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvtier.offload.config import OffloadConfig, parse_kv_offload
from kvtier.offload.host_area import HostArea
from kvtier.offload.keys import ChunkKey, make_chunk_key
from kvtier.offload.tiers.base import SecondaryTier, TierContext, TransferJob
from kvtier.offload.tiers.registry import create_tier
from kvtier.offload.tiers.remote import encode_chunk

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/stores.py: local stores

from tests.stores import SeaweedS3, ValkeyServer  # noqa: E402

STORE_KINDS = ("obj", "redis")
LOCAL_BUCKET = "kvtier-bench"
JOB_DEADLINE_S = 300.0


@contextmanager
def store_pair(store: str) -> Iterator[str]:
    """`store` as a --kv-offload pair: as given (`redis=URL`, `obj=s3://...`), or, for a bare
    `redis` / `obj`, a throwaway Valkey / SeaweedFS on 127.0.0.1 that lives for the block (its
    AWS settings in os.environ meanwhile, where the tier and child processes find them)."""
    if store not in STORE_KINDS:
        yield store
        return
    with tempfile.TemporaryDirectory(prefix=f"kvtier-bench-{store}-") as directory:
        if store == "redis":
            with ValkeyServer(Path(directory)) as valkey:
                yield f"redis={valkey.url}"
            return
        with SeaweedS3(Path(directory)) as s3:
            s3.create_bucket(LOCAL_BUCKET)
            saved = {name: os.environ.get(name) for name in s3.env()}
            os.environ.update(s3.env())
            try:
                yield f"obj=s3://{LOCAL_BUCKET}/bench"
            finally:
                for name, value in saved.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value


def is_network_store(pair: str) -> bool:
    return pair.partition("=")[0] in STORE_KINDS


def store_throughput(pair: str, area: HostArea, num_chunks: int,
                     repeats: int = 3) -> tuple[dict[str, float], dict[str, float]]:
    """(tier, raw) bytes per second, the best of `repeats` passes over `num_chunks` chunks of
    `area`'s first slots: the tier's store and load jobs (`host_to_T`, `T_to_host`) and the raw
    client's PUTs and GETs of the same objects (`T_put`, `T_get`)."""
    spec = OffloadConfig.from_extra_config(parse_kv_offload(f"host=1GiB,{pair}")).secondary_tiers[0]
    namespace = b"store-throughput-bench"
    tier = create_tier(spec.type, spec.module_path, spec.options,
                       TierContext(spec.type, namespace, max_chunk_bytes=area.slot_bytes))
    keys = [make_chunk_key(namespace, 0, i.to_bytes(32, "big")) for i in range(num_chunks)]
    names = [tier._name(key) for key in keys]
    values = [encode_chunk(key, area.slot_view(slot)) for slot, key in enumerate(keys)]
    put, get = _raw_calls(spec.type, tier)
    t = spec.type
    tier_passes = {f"host_to_{t}": lambda: run_jobs(tier, tier.submit_store, keys, area),
                   f"{t}_to_host": lambda: run_jobs(tier, tier.submit_load, keys, area)}
    # Each raw pass on as many threads as the tier's pool, at the same niceness (the tier's
    # writers run niced: on a busy machine they get less CPU than threads at normal priority).
    raw_passes = {f"{t}_put": lambda: _on_threads(put, names, values,
                                                   spec.options.num_write_threads,
                                                   spec.options.write_nice),
                  f"{t}_get": lambda: _on_threads(get, names, values,
                                                   spec.options.num_read_threads)}
    best: dict[str, float] = {}
    try:
        for _ in range(repeats):  # raw PUT, tier store, raw GET, tier load: both see one state
            for name, action in _interleaved(raw_passes, tier_passes):
                best[name] = min(best.get(name, float("inf")), _seconds(action))
    finally:
        tier.shutdown()
    num_bytes = num_chunks * area.slot_bytes
    return ({name: num_bytes / best[name] for name in tier_passes},
            {name: num_bytes / best[name] for name in raw_passes})


def _interleaved(first: dict, second: dict) -> list:
    return [item for pair in zip(first.items(), second.items()) for item in pair]


def _raw_calls(kind: str, tier: SecondaryTier) -> tuple[Callable[[str, bytes], Any],
                                                        Callable[[str, bytes], Any]]:
    """(put(name, value), get(name, _)) through the tier's own client."""
    if kind == "obj":
        client, bucket = tier._client, tier.options.bucket
        return (lambda name, value: client.put_object(Bucket=bucket, Key=name, Body=value),
                lambda name, _: client.get_object(Bucket=bucket, Key=name)["Body"].read())
    client = tier._connected()
    return (lambda name, value: client.set(name, value), lambda name, _: client.get(name))


def run_jobs(tier: SecondaryTier, submit: Callable[[TransferJob], None], keys: list[ChunkKey],
             area: HostArea) -> None:
    """One job per key (slot i for key i) through `submit`, until all have ended; raises if one
    fails or they hang."""
    deadline = time.monotonic() + JOB_DEADLINE_S
    for slot, key in enumerate(keys):
        submit(TransferJob(slot, key, area.slot_view(slot), deadline))
    num_done = 0
    while num_done < len(keys):
        results = list(tier.get_finished_jobs())
        failed = next((result for result in results if not result.ok), None)
        if failed is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{type(tier).__name__} jobs failed or hung during the throughput "
                               f"measurement: {failed}")
        num_done += len(results)
        time.sleep(0.0005)


def _on_threads(action: Callable[[str, bytes], Any], names: list[str], values: list[bytes],
                num_threads: int, nice: int = 0) -> None:
    with ThreadPoolExecutor(num_threads, initializer=_renice, initargs=(nice,)) as pool:
        list(pool.map(action, names, values))


def _renice(nice: int) -> None:
    """Add `nice` to the calling thread's niceness (Linux keeps one per thread), as the tier's
    write pool does."""
    if nice:
        os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) + nice)


def _seconds(action: Callable[[], None]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start
